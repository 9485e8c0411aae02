"""The backend conformance suite, shipped for every backend and plugin author.

Subclass :class:`BackendConformanceTests` in a test module and implement ``open_backend``::

    class TestMyBackend(BackendConformanceTests):
        async def open_backend(self, location):
            return await MyBackend.open(MyConfig(root=str(location)))

``location`` is a fresh directory per test; opening the same location again must give the same
store (that is how persistence is checked when ``capabilities.persistent`` is true). Override
``cleanup_backend`` for stores that live outside ``location`` (shared memory segments).

The suite reads the backend's ``capabilities`` rather than asking for per-backend overrides:
scan tests run only when ``listable`` (otherwise ``scan`` must raise a typed error), the reopen
test only when ``persistent``, and with ``max_object_bytes`` set, no test puts a larger object
except the one that checks it is refused.

Raw hooks (optional): implement ``read_raw(backend, key)`` and ``write_raw(backend, key, data)``
to reach the store without the backend's API (a file's bytes, an S3 object, a dict). Tests
then check that a put lands in storage, that a delete removes it, and that an object written
behind the backend's back is read back whole; the state machine also compares storage with its
model. Without them, those tests are skipped.

The suite never relies on eviction: no test holds more than ``large_object_bytes`` (or
``max_object_bytes`` when smaller) plus a few MiB at once, so open a capacity-bounded backend
with at least twice that. Every ``put`` is expected to succeed (True) under that assumption.

What only the base class does (key validation, batch shapes, buffer checks, closed-backend
errors) is checked once, in hicache's own tests against the memory backend; this suite checks
instead that the backend leaves the base class's public methods alone, so those checks hold for
it too.

Needs pytest, pytest-asyncio and hypothesis (``pip install 'hicache[test]'``); every async test
is marked, so it runs without ``asyncio_mode = auto``. The large-object test is marked ``slow``:
register that marker (``markers = ["slow: ..."]``) where pytest runs with ``--strict-markers``.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio

from hicache.backends.base import MISS, StorageBackend
from hicache.backends.testing_stateful import (
    StatefulConformanceTests,
    random_bytes,
    require_listable,
    scan_all,
)
from hicache.errors import HiCacheError, InvalidArgumentError

__all__ = ["BackendConformanceTests", "random_bytes", "scan_all"]

# The validated entry points of StorageBackend: a backend implements the "_" methods instead.
_PUBLIC_API = (
    "exists",
    "get_into",
    "put",
    "put_missing",
    "delete",
    "scan",
    "stats",
    "close",
    "leading_hits",
    "get",
    "peek",
)
_VALID_KEYS = ["0", "_", "A-b.c_d", "x.y", "Z9-", "k" * 250]


class BackendConformanceTests(StatefulConformanceTests):
    """The contract of :class:`StorageBackend`, checked against ground truth.

    Tunables: ``large_object_bytes``, ``mtime_slack_s`` (clock granularity or skew of the
    store), ``state_machine_examples`` and ``state_machine_steps``. Hooks: ``open_backend``
    (required), ``cleanup_backend``, ``read_raw`` and ``write_raw`` (see the module docstring).
    """

    #: Size of the large-object round trip, capped by ``capabilities.max_object_bytes``; lower
    #: it for a store that moves large objects slowly (a remote service).
    large_object_bytes: int = 64 << 20
    #: How far a scanned mtime may sit outside the wall-clock interval of its put.
    mtime_slack_s: float = 5.0

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        raise NotImplementedError("subclasses open their backend at `location`")

    async def cleanup_backend(self, location: pathlib.Path) -> None:
        """Remove anything the store left outside ``location``; the default does nothing."""

    @pytest_asyncio.fixture
    async def location(self, tmp_path: pathlib.Path) -> AsyncIterator[pathlib.Path]:
        path = tmp_path / "store"
        path.mkdir()
        yield path
        await self.cleanup_backend(path)

    @pytest_asyncio.fixture
    async def backend(self, location: pathlib.Path) -> AsyncIterator[StorageBackend]:
        opened = await self.open_backend(location)
        yield opened
        await opened.close()

    # ----- round trips ------------------------------------------------------------------------
    @pytest.mark.asyncio
    async def test_round_trip(self, backend: StorageBackend) -> None:
        payload = bytes(range(256)) * 17
        assert await backend.put(["k1"], [payload]) == [True]
        buf = bytearray(len(payload))
        assert await backend.get_into(["k1"], [buf]) == [len(payload)]
        assert bytes(buf) == payload

    @pytest.mark.asyncio
    async def test_caller_may_reuse_buffers_after_put(self, backend: StorageBackend) -> None:
        value = bytearray(random_bytes(3000, seed=2))
        array = np.frombuffer(random_bytes(64, seed=4), dtype=np.uint8).copy()
        expected = [bytes(value), array.tobytes()]
        assert await backend.put(["reuse-1", "reuse-2"], [value, array]) == [True, True]
        value[:] = b"\0" * len(value)  # the store must already hold its own copy
        array[:] = 0
        assert await backend.get(["reuse-1", "reuse-2"]) == expected

    @pytest.mark.asyncio
    @pytest.mark.parametrize("size", [1, 255, 4096, 4097, (1 << 20) + 3])
    async def test_round_trip_sizes(self, backend: StorageBackend, size: int) -> None:
        if size > self.large_size(backend):
            pytest.skip(f"larger than the backend's max_object_bytes ({self.large_size(backend)})")
        value = random_bytes(size, seed=size)
        assert await backend.put([f"size-{size}"], [value]) == [True]
        assert await backend.exists([f"size-{size}"]) == [True]
        buf = bytearray(size)
        assert await backend.get_into([f"size-{size}"], [buf]) == [size]
        assert buf == value
        assert await backend.get([f"size-{size}"], size_hint=size) == [value]

    @pytest.mark.asyncio
    async def test_zero_length_object(self, backend: StorageBackend) -> None:
        # Legal: an empty object is stored, exists and reads back as zero bytes.
        assert await backend.put(["empty"], [b""]) == [True]
        assert await backend.exists(["empty"]) == [True]
        assert await backend.get_into(["empty", "empty"], [bytearray(0), bytearray(8)]) == [0, 0]
        assert await backend.get(["empty"]) == [b""]
        if backend.capabilities.listable:
            assert [(i.key, i.size) for i in await scan_all(backend, "empty")] == [("empty", 0)]

    @pytest.mark.asyncio
    async def test_valid_key_alphabet(self, backend: StorageBackend) -> None:
        values = [random_bytes(10 + i, seed=i) for i in range(len(_VALID_KEYS))]
        assert await backend.put(_VALID_KEYS, values) == [True] * len(_VALID_KEYS)
        assert await backend.get(_VALID_KEYS) == values
        if backend.capabilities.listable:
            listed = {i.key: i.size for i in await scan_all(backend)}
            assert listed == {k: len(v) for k, v in zip(_VALID_KEYS, values, strict=True)}

    @pytest.mark.asyncio
    async def test_scatter_gather_segments(self, backend: StorageBackend) -> None:
        header = b"HDR!" * 4
        payload = bytearray(random_bytes(1000, seed=1))
        tail = np.arange(100, dtype=np.uint8)
        expected = header + bytes(payload) + tail.tobytes()
        assert await backend.put(["sg"], [[header, memoryview(payload), tail]]) == [True]
        # Segment boundaries unlike the put's, including an empty segment.
        parts = [bytearray(7), memoryview(bytearray(0)), np.empty(500, np.uint8), bytearray(609)]
        assert await backend.get_into(["sg"], [parts]) == [len(expected)]
        assert b"".join(bytes(p) for p in parts) == expected
        # More room than needed, as a tuple: the first n bytes across segments are the object.
        roomy = (bytearray(100), bytearray(len(expected)))
        assert await backend.get_into(["sg"], [roomy]) == [len(expected)]
        assert (bytes(roomy[0]) + bytes(roomy[1]))[: len(expected)] == expected

    @pytest.mark.asyncio
    @pytest.mark.parametrize("dtype", ["float16", "float32", "int64", "complex64"])
    async def test_numpy_buffers_of_any_dtype(self, backend: StorageBackend, dtype: str) -> None:
        raw = np.frombuffer(random_bytes(6 * 8 * 8, seed=3), dtype=np.uint8)
        array = raw.view(dtype).reshape(6, -1)  # 2-D, C-contiguous, stored as its bytes
        assert await backend.put(["arr"], [array]) == [True]
        out = np.zeros_like(array)
        assert await backend.get_into(["arr"], [out]) == [array.nbytes]
        assert out.tobytes() == array.tobytes()
        assert await backend.get(["arr"]) == [array.tobytes()]

    # ----- batches ----------------------------------------------------------------------------
    @pytest.mark.asyncio
    async def test_batch_results_follow_key_order(self, backend: StorageBackend) -> None:
        values = {f"ord-{i}": random_bytes(10 * i + 1, seed=i) for i in range(6)}
        assert await backend.put(list(values), list(values.values())) == [True] * 6
        order = ["ord-4", "ord-0", "ord-5", "ord-2", "ord-1", "ord-3"]
        buffers = [bytearray(len(values[k])) for k in order]
        assert await backend.get_into(order, buffers) == [len(values[k]) for k in order]
        assert [bytes(b) for b in buffers] == [values[k] for k in order]

    @pytest.mark.asyncio
    async def test_mixed_hits_and_misses(self, backend: StorageBackend) -> None:
        assert await backend.put(["m0", "m2"], [b"zero", b"two!!"]) == [True, True]
        keys = ["m0", "m1", "m2", "m3"]
        assert await backend.exists(keys) == [True, False, True, False]
        bufs = [bytearray(8) for _ in keys]
        assert await backend.get_into(keys, bufs) == [4, MISS, 5, MISS]
        assert bytes(bufs[0][:4]) == b"zero" and bytes(bufs[2][:5]) == b"two!!"
        assert await backend.get(keys) == [b"zero", None, b"two!!", None]
        assert await backend.delete(["m0", "m1"]) == [True, False]

    @pytest.mark.asyncio
    async def test_duplicate_keys_in_reads(self, backend: StorageBackend) -> None:
        assert await backend.put(["dup"], [b"value"]) == [True]
        assert await backend.exists(["dup", "dup"]) == [True, True]
        bufs = [bytearray(5), bytearray(5)]
        assert await backend.get_into(["dup", "dup"], bufs) == [5, 5]
        assert bufs == [b"value", b"value"]

    # ----- leading hits -----------------------------------------------------------------------
    @pytest.mark.asyncio
    async def test_leading_hits(self, backend: StorageBackend) -> None:
        keys = [f"lh-{i}" for i in range(10)]
        present = [k for k in keys if k != "lh-5"]
        assert await backend.put(present, [b"p"] * 9) == [True] * 9
        for batch_size in (1, 2, 3, 128):
            assert await backend.leading_hits(keys, batch_size=batch_size) == 5
            assert await backend.leading_hits(keys[:5], batch_size=batch_size) == 5
            assert await backend.leading_hits(["lh-5", *keys], batch_size=batch_size) == 0
            assert await backend.leading_hits([], batch_size=batch_size) == 0
        with pytest.raises(InvalidArgumentError):
            await backend.leading_hits(keys, batch_size=0)

    @pytest.mark.asyncio
    async def test_leading_hits_across_batch_boundaries(self, backend: StorageBackend) -> None:
        keys = [f"chain-{i:03d}" for i in range(300)]
        assert await backend.put(keys, [b"c"] * 300) == [True] * 300
        assert await backend.leading_hits(keys, batch_size=128) == 300
        for gap in (200, 128, 127, 0, 299):
            assert await backend.delete([keys[gap]]) == [True]
            assert await backend.leading_hits(keys, batch_size=128) == gap, gap
            assert await backend.put([keys[gap]], [b"c"]) == [True]

    @pytest.mark.asyncio
    async def test_peek_reads_the_start_of_each_object(self, backend: StorageBackend) -> None:
        values = {"pk-0": b"", "pk-1": random_bytes(10, 1), "pk-2": random_bytes(5000, 2)}
        assert await backend.put(list(values), list(values.values())) == [True] * 3
        keys = ["pk-2", "pk-absent", *values]
        got = await backend.peek(keys, 160)
        assert got == [values["pk-2"][:160], None, b"", values["pk-1"], values["pk-2"][:160]]
        assert await backend.peek(["pk-2", "pk-1"], 0) == [b"", b""]
        assert await backend.peek(["pk-2"], 1 << 20) == [values["pk-2"]]
        assert await backend.peek([], 8) == []
        assert await backend.get(list(values)) == list(values.values())  # unchanged
        with pytest.raises(InvalidArgumentError):
            await backend.peek(["pk-1"], -1)

    # ----- overwrite, delete, scan --------------------------------------------------------------
    @pytest.mark.asyncio
    async def test_overwrite_replaces(self, backend: StorageBackend) -> None:
        for size in (1000, 10, 5000):
            value = random_bytes(size, seed=size)
            assert await backend.put(["ow"], [value]) == [True]
            buf = bytearray(8000)
            assert await backend.get_into(["ow"], [buf]) == [size]
            assert buf[:size] == value
            if backend.capabilities.listable:
                assert [(i.key, i.size) for i in await scan_all(backend, "ow")] == [("ow", size)]

    @pytest.mark.asyncio
    async def test_put_missing_keeps_what_is_stored(self, backend: StorageBackend) -> None:
        first, second = random_bytes(700, seed=1), random_bytes(700, seed=2)
        assert await backend.put(["pm-old"], [first]) == [True]
        got = await backend.put_missing(
            ["pm-old", "pm-new"], [second, [second[:300], second[300:]]]
        )
        assert got == [True, True]
        assert await backend.get(["pm-old", "pm-new"]) == [first, second]
        with pytest.raises(InvalidArgumentError):
            await backend.put_missing(["pm-a", "pm-a"], [first, second])

    @pytest.mark.asyncio
    async def test_delete(self, backend: StorageBackend) -> None:
        assert await backend.put(["d1", "d2"], [b"one", b"two"]) == [True, True]
        assert await backend.delete(["d1"]) == [True]
        assert await backend.delete(["d1", "never"]) == [False, False]
        assert await backend.exists(["d1", "d2"]) == [False, True]
        assert await backend.get_into(["d1"], [bytearray(3)]) == [MISS]
        assert await backend.get(["d1"]) == [None]
        if backend.capabilities.listable:
            assert [i.key for i in await scan_all(backend)] == ["d2"]
        assert await backend.put(["d1"], [b"again"]) == [True]
        assert await backend.get(["d1"]) == [b"again"]

    @pytest.mark.asyncio
    async def test_scan_lists_keys_with_sizes(self, backend: StorageBackend) -> None:
        require_listable(backend)
        values = {"alpha-1": b"a" * 3, "alpha-2": b"", "alphabet": b"b" * 7, "beta-1": b"c"}
        before = time.time()
        assert await backend.put(list(values), list(values.values())) == [True] * 4
        after = time.time()
        infos = await scan_all(backend)
        assert sorted((i.key, i.size) for i in infos) == sorted(
            (k, len(v)) for k, v in values.items()
        )
        for info in infos:
            assert before - self.mtime_slack_s <= info.mtime <= after + self.mtime_slack_s
        for prefix, expected in [
            ("alpha", {"alpha-1", "alpha-2", "alphabet"}),
            ("alpha-", {"alpha-1", "alpha-2"}),
            ("beta-1", {"beta-1"}),
            ("gamma", set()),
        ]:
            keys = [i.key for i in await scan_all(backend, prefix)]
            assert sorted(keys) == sorted(expected), prefix

    # ----- misses and buffers -------------------------------------------------------------------
    @pytest.mark.asyncio
    async def test_miss(self, backend: StorageBackend) -> None:
        buf = bytearray(8)
        assert await backend.get_into(["absent"], [buf]) == [MISS]
        assert await backend.exists(["absent"]) == [False]
        assert await backend.get(["absent"]) == [None]

    @pytest.mark.asyncio
    async def test_buffer_too_small_reports_size(self, backend: StorageBackend) -> None:
        value = random_bytes(1000, seed=5)
        assert await backend.put(["big"], [value]) == [True]
        assert await backend.get_into(["big"], [bytearray(10)]) == [1000]
        assert await backend.get(["big"], size_hint=16) == [value]  # retries at the real size

    @pytest.mark.asyncio
    async def test_buffer_larger_than_object(self, backend: StorageBackend) -> None:
        value = random_bytes(1000, seed=6)
        assert await backend.put(["small"], [value]) == [True]
        buf = bytearray(b"\xee" * 4096)
        assert await backend.get_into(["small"], [buf]) == [1000]
        assert buf[:1000] == value

    # ----- capabilities and the base class's API ----------------------------------------------
    @pytest.mark.asyncio
    async def test_public_api_is_the_base_classes(self, backend: StorageBackend) -> None:
        # The base validates every argument in these methods; a backend that overrode one would
        # skip that, and the checks run once against the memory backend would not cover it.
        cls = type(backend)
        overridden = [n for n in _PUBLIC_API if getattr(cls, n) is not getattr(StorageBackend, n)]
        assert overridden == [], f"implement the '_' methods instead of overriding {overridden}"

    @pytest.mark.asyncio
    async def test_stats_report_bytes_staged(self, backend: StorageBackend) -> None:
        # Bytes copied through the backend's own buffers: 0 for one that never stages, and a
        # count that only grows for one that does (``hicache serve --json`` reports it).
        before = (await backend.stats())["bytes_staged"]
        assert isinstance(before, int) and before >= 0
        assert await backend.put(["staged"], [[b"head", b"payload"]]) == [True]
        assert await backend.get(["staged"]) == [b"headpayload"]
        after = (await backend.stats())["bytes_staged"]
        assert isinstance(after, int) and after >= before

    @pytest.mark.asyncio
    async def test_scan_follows_the_listable_capability(self, backend: StorageBackend) -> None:
        if backend.capabilities.listable:
            assert await scan_all(backend) == []  # a fresh store lists nothing
        else:  # a store that cannot list says so with a typed error, whatever the prefix
            for prefix in ("", "k"):
                with pytest.raises(HiCacheError):
                    await scan_all(backend, prefix)

    @pytest.mark.asyncio
    async def test_object_over_the_size_cap_is_refused(self, backend: StorageBackend) -> None:
        cap = backend.capabilities.max_object_bytes
        if cap is None:
            pytest.skip(f"{type(backend).__name__} has no max_object_bytes (capabilities)")
        too_big = np.zeros(cap + 1, dtype=np.uint8)  # zero pages: nothing is touched until read
        before = await backend.stats()
        assert await backend.put(["capped", "fits"], [too_big, b"small"]) == [False, True]
        assert await backend.exists(["capped", "fits"]) == [False, True]
        after = await backend.stats()
        assert after["put_failures"] - before["put_failures"] == 1

    # ----- raw hooks: the store itself, reached without the API ------------------------------
    @pytest.mark.asyncio
    async def test_put_lands_in_storage_and_delete_removes_it(
        self, backend: StorageBackend
    ) -> None:
        self.require_raw_hooks()
        value, parts = random_bytes(3000, seed=11), [b"head", random_bytes(500, seed=12), b""]
        assert await backend.put(["raw-1", "raw-2", "raw-0"], [value, parts, b""]) == [True] * 3
        assert await self.read_raw(backend, "raw-1") == value
        assert await self.read_raw(backend, "raw-2") == b"".join(parts)
        assert await self.read_raw(backend, "raw-0") == b""
        assert await backend.put(["raw-1"], [b"shorter"]) == [True]
        assert await self.read_raw(backend, "raw-1") == b"shorter"
        assert await backend.delete(["raw-1", "raw-0"]) == [True, True]
        assert await self.read_raw(backend, "raw-1") is None
        assert await self.read_raw(backend, "raw-0") is None
        assert await self.read_raw(backend, "raw-never") is None

    @pytest.mark.asyncio
    async def test_object_written_raw_is_read_whole(self, backend: StorageBackend) -> None:
        self.require_raw_hooks()
        value = random_bytes(5000, seed=13)
        await self.write_raw(backend, "raw-w", value)
        await self.write_raw(backend, "raw-e", b"")
        assert await backend.exists(["raw-w", "raw-e", "raw-x"]) == [True, True, False]
        buf = bytearray(len(value))
        assert await backend.get_into(["raw-w"], [buf]) == [len(value)] and buf == value
        assert await backend.get(["raw-w", "raw-e"]) == [value, b""]
        assert await backend.peek(["raw-w"], 100) == [value[:100]]
        if backend.capabilities.listable:
            listed = {i.key: i.size for i in await scan_all(backend, "raw-")}
            assert listed == {"raw-w": len(value), "raw-e": 0}
        # Another writer rewrites the object (same size: a key names one page, whose size never
        # changes in normal use, so a store may remember sizes).
        rewritten = random_bytes(len(value), seed=14)
        await self.write_raw(backend, "raw-w", rewritten)
        assert await backend.get(["raw-w"]) == [rewritten]
        assert await backend.delete(["raw-w"]) == [True]
        assert await self.read_raw(backend, "raw-w") is None
