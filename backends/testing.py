"""The backend conformance suite, shipped for every backend and plugin author.

Subclass :class:`BackendConformanceTests` in a test module and implement ``open_backend``::

    class TestMyBackend(BackendConformanceTests):
        async def open_backend(self, location):
            return await MyBackend.open(MyConfig(root=str(location)))

``location`` is a fresh directory per test; opening the same location again must give the same
store (that is how persistence is checked when ``capabilities.persistent`` is true). Override
``cleanup_backend`` for stores that live outside ``location`` (shared memory segments).

The suite never relies on eviction: no test holds more than ``large_object_bytes`` plus a few
MiB at once, so open a capacity-bounded backend with at least twice ``large_object_bytes``
(or lower ``large_object_bytes`` for a store with a documented object cap). Every ``put`` is
expected to succeed (True) under that assumption.

Needs pytest, pytest-asyncio and hypothesis (``pip install 'hicache[test]'``); every async test
is marked, so it runs without ``asyncio_mode = auto``.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from hicache.backends.base import MISS, StorageBackend
from hicache.backends.testing_stateful import StatefulConformanceTests, random_bytes, scan_all
from hicache.errors import InvalidArgumentError, InvalidKeyError

__all__ = ["BackendConformanceTests"]

# (id, key): refused by every method. All but "" are refused as scan prefixes too.
_BAD_KEYS: list[tuple[str, object]] = [
    ("slash", "/"),
    ("path", "a/b"),
    ("dotdot", ".."),
    ("inner-dotdot", "a..b"),
    ("empty", ""),
    ("too-long", "k" * 251),
    ("non-ascii", "é"),
    ("nul", "a\x00b"),
    ("leading-dot", ".hidden"),
    ("leading-dash", "-flag"),
    ("space", "a b"),
    ("int", 7),
    ("bytes", b"key"),
]
_VALID_KEYS = ["0", "_", "A-b.c_d", "x.y", "Z9-", "k" * 250]


class BackendConformanceTests(StatefulConformanceTests):
    """The contract of :class:`StorageBackend`, checked against ground truth.

    Tunables: ``large_object_bytes``, ``mtime_slack_s`` (clock granularity or skew of the
    store), ``state_machine_examples`` and ``state_machine_steps``.
    """

    #: Size of the large-object round trip; lower it only for stores with a documented cap.
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
        assert [(i.key, i.size) for i in await scan_all(backend, "empty")] == [("empty", 0)]

    @pytest.mark.asyncio
    async def test_valid_key_alphabet(self, backend: StorageBackend) -> None:
        values = [random_bytes(10 + i, seed=i) for i in range(len(_VALID_KEYS))]
        assert await backend.put(_VALID_KEYS, values) == [True] * len(_VALID_KEYS)
        assert await backend.get(_VALID_KEYS) == values
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

    @pytest.mark.asyncio
    async def test_empty_batches(self, backend: StorageBackend) -> None:
        assert await backend.exists([]) == []
        assert await backend.get_into([], []) == []
        assert await backend.put([], []) == []
        assert await backend.delete([]) == []
        assert await backend.get([]) == []
        assert await backend.leading_hits([]) == 0
        assert await scan_all(backend) == []

    @pytest.mark.asyncio
    async def test_bad_batches_raise_and_store_nothing(self, backend: StorageBackend) -> None:
        bad_calls: list[Any] = [
            backend.get_into(["a", "b"], [bytearray(1)]),
            backend.put(["a", "b"], [b"x"]),
            backend.put(["a"], [b"x", b"y"]),
            backend.put(["a", "b", "a"], [b"1", b"2", b"3"]),  # a key twice in one put
            backend.put(["a", "b"], [b"x", "text"]),  # not a buffer
            backend.put(["a", "b"], [b"x", 12]),
        ]
        for call in bad_calls:
            with pytest.raises(InvalidArgumentError):
                await call
        assert await backend.exists(["a", "b"]) == [False, False]

    @pytest.mark.asyncio
    async def test_single_str_instead_of_list_raises(self, backend: StorageBackend) -> None:
        calls: list[Any] = [
            backend.exists("abc"),
            backend.get_into("abc", [bytearray(1)] * 3),
            backend.put("abc", [b"x"] * 3),
            backend.delete("abc"),
            backend.leading_hits("abc"),
            backend.get("abc"),
        ]
        for call in calls:
            with pytest.raises(InvalidArgumentError):
                await call
        assert await backend.exists(["a", "b", "c", "abc"]) == [False] * 4

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
            assert [(i.key, i.size) for i in await scan_all(backend, "ow")] == [("ow", size)]

    @pytest.mark.asyncio
    async def test_delete(self, backend: StorageBackend) -> None:
        assert await backend.put(["d1", "d2"], [b"one", b"two"]) == [True, True]
        assert await backend.delete(["d1"]) == [True]
        assert await backend.delete(["d1", "never"]) == [False, False]
        assert await backend.exists(["d1", "d2"]) == [False, True]
        assert await backend.get_into(["d1"], [bytearray(3)]) == [MISS]
        assert await backend.get(["d1"]) == [None]
        assert [i.key for i in await scan_all(backend)] == ["d2"]
        assert await backend.put(["d1"], [b"again"]) == [True]
        assert await backend.get(["d1"]) == [b"again"]

    @pytest.mark.asyncio
    async def test_scan_lists_keys_with_sizes(self, backend: StorageBackend) -> None:
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

    @pytest.mark.asyncio
    async def test_unusable_buffers_raise(self, backend: StorageBackend) -> None:
        assert await backend.put(["obj"], [b"x" * 100]) == [True]
        strided = np.zeros(200, dtype=np.uint8)[::2]  # a view with gaps
        read_only = [b"\0" * 100, memoryview(bytes(100)), [bytearray(50), bytes(50)]]
        for buffer in [*read_only, strided, "text", 5]:
            with pytest.raises(InvalidArgumentError):
                await backend.get_into(["obj"], [buffer])
        with pytest.raises(InvalidArgumentError):
            await backend.put(["strided"], [strided])
        assert await backend.exists(["strided"]) == [False]

    # ----- invalid keys -----------------------------------------------------------------------
    @pytest.mark.asyncio
    @pytest.mark.parametrize("bad", [k for _, k in _BAD_KEYS], ids=[i for i, _ in _BAD_KEYS])
    async def test_invalid_key_is_refused_everywhere(
        self, backend: StorageBackend, bad: Any
    ) -> None:
        assert await backend.put(["good"], [b"kept"]) == [True]
        calls: list[Any] = [
            backend.exists(["good", bad]),
            backend.get_into(["good", bad], [bytearray(4), bytearray(4)]),
            backend.put(["fresh", bad], [b"new", b"new"]),
            backend.delete(["good", bad]),
            backend.leading_hits(["good", bad]),
            backend.get(["good", bad]),
            backend.peek(["good", bad], 4),
        ]
        if bad != "":  # "" is the prefix that matches everything
            calls.append(scan_all(backend, bad))
        for call in calls:
            with pytest.raises(InvalidKeyError):
                await call
        # Nothing of a batch with a bad key happened.
        assert await backend.exists(["good", "fresh"]) == [True, False]
        assert [i.key for i in await scan_all(backend)] == ["good"]
