"""Large records that hold a hicache page are checked by the page's own checksum (issue 48).

``disk://`` stores such a record with its page's checksum as the record's (``PAGE_DIGEST``),
so a put hashes nothing and a get hashes each byte once, as it reads; the codec's own pass is
then skipped (``Capabilities.checks_pages_over``). Every byte must still be checked: a page put
with a damaged payload, a byte flipped on disk in the page header or the payload, and an older
record (its xxh3 over the whole payload, no flag) holding a damaged page all read as misses,
by the pieced reads and by ``direct=true``'s, by a reclaim's check and by a segment walk.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
from disk_kit import open_disk, segment_files

from hicache.backends.disk import format as disk_format
from hicache.backends.disk.format import PAGE_DIGEST, RECORD_HEADER, parse_record_header
from hicache.backends.disk.segments import Found, walk_segment
from hicache.backends.wrappers.faults import FaultInjectionBackend
from hicache.codec import HEADER_SIZE, PageMeta, check_into, encode_page, payload_checked_by
from hicache.dtypes import DType
from hicache.errors import PayloadChecksumError

PAYLOAD = (3 << 20) + 4096  # three pieces and a bit: over LARGE_RECORD_BYTES
META = PageMeta("kv", DType.UINT8, (PAYLOAD,))


def _page(key: str, seed: int) -> tuple[list[bytes | memoryview], bytes]:
    payload = np.random.default_rng(seed).integers(0, 256, PAYLOAD, dtype=np.uint8).tobytes()
    return encode_page(key, payload, META), payload


def _record(root: pathlib.Path, backend: object, key: str) -> tuple[pathlib.Path, int, object]:
    """The segment, offset and parsed header of ``key``'s record."""
    _, offset, _, _ = backend.catalog.index.get(key)  # type: ignore[attr-defined]
    seg = next(p for p in segment_files(root) if p.stat().st_size > offset)
    with open(seg, "rb") as f:
        f.seek(offset)
        header = parse_record_header(f.read(RECORD_HEADER + 64), key.encode())
    assert header is not None
    return seg, offset + RECORD_HEADER + len(key) + header.gap, header


def _flip(seg: pathlib.Path, at: int) -> None:
    with open(seg, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))


async def _read(backend: object, key: str) -> tuple[int, bytearray, bytearray]:
    header, payload = bytearray(HEADER_SIZE), bytearray(PAYLOAD)
    (n,) = await backend.get_into([key], [[header, payload]])  # type: ignore[attr-defined]
    return n, header, payload


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.asyncio
async def test_a_large_page_is_stored_with_its_own_checksum_and_read_checked(
    tmp_path: pathlib.Path, direct: bool
) -> None:
    backend = await open_disk(tmp_path, direct=direct)
    segs, payload = _page("p", 1)
    assert await backend.put(["p"], [segs]) == [True]
    _, _, header = _record(tmp_path, backend, "p")
    assert header.page_digest and header.payload_hash == int.from_bytes(segs[0][124:132], "little")
    n, head, got = await _read(backend, "p")
    assert n == HEADER_SIZE + PAYLOAD and bytes(got) == payload
    over = backend.capabilities.checks_pages_over
    assert over is not None and payload_checked_by(over, n) and not payload_checked_by(over, over)
    check_into("p", head, got, n, META, payload_checked=True)  # header, key, kind still checked
    with pytest.raises(PayloadChecksumError):  # without the flag the codec hashes as before
        check_into("p", head, bytearray(PAYLOAD), n, META)
    await backend.close()


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("damage", ["put damaged", "page header", "first piece", "last piece"])
@pytest.mark.asyncio
async def test_a_damaged_large_page_is_a_miss(
    tmp_path: pathlib.Path, damage: str, direct: bool
) -> None:
    """A page whose payload no longer matches its header's checksum, however it got so."""
    backend = await open_disk(tmp_path, direct=direct)
    segs, _ = _page("p", 2)
    good, good_payload = _page("q", 3)
    if damage == "put damaged":
        bad = bytearray(segs[1])
        bad[-1] ^= 0xFF
        segs = [segs[0], bytes(bad)]
    assert await backend.put(["p", "q"], [segs, good]) == [True, True]
    seg, payload_at, _ = _record(tmp_path, backend, "p")
    await backend.close()
    at = {
        "page header": 20,
        "first piece": HEADER_SIZE + 7,
        "last piece": HEADER_SIZE + PAYLOAD - 1,
    }
    if damage in at:
        _flip(seg, payload_at + at[damage])
    backend = await open_disk(tmp_path, direct=direct)
    assert (await _read(backend, "p"))[0] < 0
    n, _, got = await _read(backend, "q")
    assert n == HEADER_SIZE + PAYLOAD and bytes(got) == good_payload
    assert (await backend.stats())["bad_records"] == 1
    assert await backend.exists(["p"]) == [False]  # forgotten
    await backend.close()


@pytest.mark.asyncio
async def test_an_older_record_holding_a_damaged_page_is_a_miss(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written before PAGE_DIGEST (the record's xxh3 over a damaged page, so that it matches):
    the page's own checksum is checked too, so a reader may still skip the codec's pass."""
    monkeypatch.setattr(
        "hicache.backends.disk.writer.record_digest",
        lambda segs, length: (disk_format.payload_hash(segs), 0),
    )
    backend = await open_disk(tmp_path)
    segs, _ = _page("p", 4)
    bad = bytearray(segs[1])
    bad[5] ^= 0xFF
    intact, _ = _page("q", 5)
    assert await backend.put(["p", "q"], [[segs[0], bytes(bad)], intact]) == [True, True]
    seg, _, header = _record(tmp_path, backend, "p")
    assert not header.page_digest
    assert (await _read(backend, "p"))[0] < 0
    assert (await _read(backend, "q"))[0] == HEADER_SIZE + PAYLOAD
    with open(seg, "rb") as f:
        walked = [r for r in walk_segment(f.fileno(), seg.stat().st_size, payloads=True)]
    # The damaged record stays in its segment (the index forgot it); a walk finds it damaged.
    assert {r.key: r.intact for r in walked if isinstance(r, Found)} == {"p": False, "q": True}
    await backend.close()


@pytest.mark.asyncio
async def test_a_walk_checks_page_records_and_the_flag_is_only_on_pages(
    tmp_path: pathlib.Path,
) -> None:
    backend = await open_disk(tmp_path)
    segs, _ = _page("p", 6)
    raw = os.urandom(PAYLOAD + HEADER_SIZE)  # as large, but no page: the record's own xxh3
    assert await backend.put(["p", "raw"], [segs, raw]) == [True, True]
    seg, payload_at, header = _record(tmp_path, backend, "p")
    assert header.page_digest
    assert not _record(tmp_path, backend, "raw")[2].page_digest
    await backend.close()
    with open(seg, "rb") as f:
        walked = [r for r in walk_segment(f.fileno(), seg.stat().st_size, payloads=True)]
    assert {r.key: r.intact for r in walked if isinstance(r, Found)} == {"p": True, "raw": True}
    _flip(seg, payload_at + HEADER_SIZE + 100)
    with open(seg, "rb") as f:
        walked = [r for r in walk_segment(f.fileno(), seg.stat().st_size, payloads=True)]
    assert {r.key: r.intact for r in walked if isinstance(r, Found)} == {"p": False, "raw": True}
    assert PAGE_DIGEST & 0x3F == 0  # the flag never reads as part of the gap


@pytest.mark.asyncio
async def test_a_fault_wrapper_does_not_claim_the_page_check(tmp_path: pathlib.Path) -> None:
    """It corrupts bytes after the store checked them: its readers must hash them again."""
    backend = await open_disk(tmp_path)
    assert backend.capabilities.checks_pages_over is not None
    assert FaultInjectionBackend(backend).capabilities.checks_pages_over is None
    await backend.close()
