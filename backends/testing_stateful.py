"""The conformance suite's tests of behaviour over time: concurrency, persistence and the model.

:class:`StatefulConformanceTests` is a mixin of
:class:`hicache.backends.testing.BackendConformanceTests` (subclass that one, not this). Its
centrepiece is a Hypothesis state machine that drives the backend under test and a plain dict
(the reference semantics, which ``MemoryBackend`` implements) with the same random operations
and compares every answer, and, when the test class has raw hooks, what storage holds too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import pathlib
import random
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hicache.backends.base import MISS, ObjectInfo, StorageBackend

__all__ = ["StatefulConformanceTests", "SuiteHooks", "random_bytes", "require_listable", "scan_all"]

T = TypeVar("T")

# Keys share prefixes ("k", "p-", "p-a") so prefix scans have something to filter.
_MODEL_KEYS = ("k0", "k1", "k2", "k10", "p-a", "p-b", "p-ab")
_MODEL_PREFIXES = ("", "k", "k1", "p-", "p-a", "zz")
_model_keys = st.sampled_from(_MODEL_KEYS)
_model_values = st.binary(max_size=48)


def random_bytes(size: int, seed: int) -> bytes:
    """Reproducible bytes that differ at every offset, so a misplaced copy shows."""
    return random.Random(seed).randbytes(size)


async def scan_all(backend: StorageBackend, prefix: str = "") -> list[ObjectInfo]:
    """Everything ``scan(prefix)`` yields, in order; raising at call or at iteration alike."""
    return [info async for info in backend.scan(prefix)]


class SuiteHooks:
    """What the suite asks of a backend's test class (declared fully on the public class)."""

    large_object_bytes: int = 64 << 20
    #: Examples and steps of the state machine: a few seconds per backend.
    state_machine_examples: int = 25
    state_machine_steps: int = 30

    async def open_backend(self, location: pathlib.Path) -> StorageBackend:
        raise NotImplementedError("subclasses open their backend at `location`")

    async def cleanup_backend(self, location: pathlib.Path) -> None:
        """Remove anything the store left outside ``location``; the default does nothing."""

    # ----- raw hooks: optional, to check a backend against what storage really holds ---------
    async def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        """The bytes stored under ``key``, read without the backend's API; None when absent.

        Optional: the tests that need it are skipped when a test class does not implement it.
        """
        raise NotImplementedError

    async def write_raw(self, backend: StorageBackend, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` without the backend's API, as another writer would.

        Optional: the tests that need it are skipped when a test class does not implement it.
        """
        raise NotImplementedError

    def has_raw_hooks(self) -> bool:
        """Whether this test class implements both raw hooks."""
        cls = type(self)
        return cls.read_raw is not SuiteHooks.read_raw and cls.write_raw is not SuiteHooks.write_raw

    def require_raw_hooks(self) -> None:
        if not self.has_raw_hooks():
            pytest.skip(f"{type(self).__name__} has no raw hooks (read_raw, write_raw)")

    def large_size(self, backend: StorageBackend) -> int:
        """``large_object_bytes``, or the backend's ``max_object_bytes`` when that is smaller."""
        cap = backend.capabilities.max_object_bytes
        return self.large_object_bytes if cap is None else min(self.large_object_bytes, cap)


def require_listable(backend: StorageBackend) -> None:
    """Skip the calling test unless ``backend`` can list (``capabilities.listable``)."""
    if not backend.capabilities.listable:
        pytest.skip(f"{type(backend).__name__} cannot list (capabilities.listable is False)")


class _ReferenceModel(RuleBasedStateMachine):
    """One backend, freshly opened, against a dict; every rule compares their answers.

    The machine is synchronous, so it runs the backend on its own event loop.
    """

    def __init__(self, suite: SuiteHooks, location: pathlib.Path) -> None:
        super().__init__()
        self.suite = suite
        self.location = location
        self.loop = asyncio.new_event_loop()
        self.model: dict[str, bytes] = {}
        self.backend = self._run(suite.open_backend(location))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    @rule(items=st.dictionaries(_model_keys, _model_values, max_size=3))
    def put(self, items: dict[str, bytes]) -> None:
        keys = list(items)
        assert self._run(self.backend.put(keys, [items[k] for k in keys])) == [True] * len(keys)
        self.model.update(items)

    @rule(keys=st.lists(_model_keys, unique=True, max_size=3))
    def delete(self, keys: list[str]) -> None:
        expected = [k in self.model for k in keys]
        assert self._run(self.backend.delete(keys)) == expected
        for key in keys:
            self.model.pop(key, None)

    @rule(keys=st.lists(_model_keys, max_size=4))
    def exists(self, keys: list[str]) -> None:
        assert self._run(self.backend.exists(keys)) == [k in self.model for k in keys]

    @rule(keys=st.lists(_model_keys, max_size=4), slack=st.integers(-8, 8))
    def get_into(self, keys: list[str], slack: int) -> None:
        # Buffers a little smaller or larger than the object: both size rules get exercised.
        buffers = [bytearray(max(len(self.model.get(k, b"")) + slack, 0)) for k in keys]
        results = self._run(self.backend.get_into(keys, buffers))
        assert len(results) == len(keys)
        for key, buf, n in zip(keys, buffers, results, strict=True):
            value = self.model.get(key)
            if value is None:
                assert n == MISS, key
            else:
                assert n == len(value), key
                if n <= len(buf):
                    assert buf[:n] == value, key

    @rule(keys=st.lists(_model_keys, max_size=4), size_hint=st.integers(0, 64))
    def get(self, keys: list[str], size_hint: int) -> None:
        got = self._run(self.backend.get(keys, size_hint=size_hint))
        assert got == [self.model.get(k) for k in keys]

    @rule(keys=st.lists(_model_keys, max_size=6), batch_size=st.integers(1, 4))
    def leading_hits(self, keys: list[str], batch_size: int) -> None:
        expected = len(list(itertools.takewhile(self.model.__contains__, keys)))
        assert self._run(self.backend.leading_hits(keys, batch_size=batch_size)) == expected

    @precondition(lambda self: self.backend.capabilities.listable)
    @rule(prefix=st.sampled_from(_MODEL_PREFIXES))
    def scan(self, prefix: str) -> None:
        listed = sorted((i.key, i.size) for i in self._run(scan_all(self.backend, prefix)))
        expected = sorted((k, len(v)) for k, v in self.model.items() if k.startswith(prefix))
        assert listed == expected

    @precondition(lambda self: self.suite.has_raw_hooks())
    @rule(key=_model_keys)
    def in_storage(self, key: str) -> None:
        # What the API reported stored is what storage holds; nothing is left of a deleted key.
        assert self._run(self.suite.read_raw(self.backend, key)) == self.model.get(key), key

    def teardown(self) -> None:
        try:
            self._run(self.backend.close())
            self._run(self.suite.cleanup_backend(self.location))
        finally:
            self.loop.close()


class StatefulConformanceTests(SuiteHooks):
    """Concurrency, large objects, close/reopen, counters and the reference-model machine."""

    def test_matches_reference_model(self, tmp_path: pathlib.Path) -> None:
        # Synchronous on purpose: the machine runs its own loop, which cannot nest in a running
        # one. Each example opens a fresh store in a fresh sub-directory.
        counter = itertools.count()

        def new_machine() -> _ReferenceModel:
            location = tmp_path / f"example-{next(counter)}"
            location.mkdir()
            return _ReferenceModel(self, location)

        run_state_machine_as_test(
            new_machine,  # type: ignore[arg-type]  # documented: a factory, not only a class
            settings=settings(
                max_examples=self.state_machine_examples,
                stateful_step_count=self.state_machine_steps,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )

    @pytest.mark.asyncio
    async def test_concurrent_tasks_on_distinct_keys(self, backend: StorageBackend) -> None:
        async def one(i: int) -> None:
            key, value = f"conc-{i}", random_bytes(1000 + i, seed=i)
            assert await backend.put([key], [value]) == [True]
            assert await backend.exists([key]) == [True]
            buf = bytearray(len(value))
            assert await backend.get_into([key], [buf]) == [len(value)]
            assert buf == value
            assert await backend.delete([key]) == [True]
            assert await backend.exists([key]) == [False]

        await asyncio.gather(*(one(i) for i in range(64)))
        if backend.capabilities.listable:
            assert await scan_all(backend, "conc-") == []

    @pytest.mark.asyncio
    async def test_concurrent_overwrites_are_never_torn(self, backend: StorageBackend) -> None:
        size, writers = 256 << 10, 8
        patterns = {p: bytes([p]) * size for p in range(writers + 1)}
        assert await backend.put(["shared"], [patterns[0]]) == [True]

        async def write(p: int) -> None:
            for _ in range(4):
                assert await backend.put(["shared"], [patterns[p]]) == [True]
                await asyncio.sleep(0)  # a yield point, so memory-speed tasks interleave

        async def read() -> None:
            buf = bytearray(size)
            for _ in range(8):
                assert await backend.get_into(["shared"], [buf]) == [size]
                assert buf[0] in patterns and buf == patterns[buf[0]], "a torn read"
                await asyncio.sleep(0)

        await asyncio.gather(
            *(write(p) for p in range(1, writers + 1)), *(read() for _ in range(16))
        )
        (final,) = await backend.get(["shared"], size_hint=size)
        assert final is not None and final in {patterns[p] for p in range(1, writers + 1)}

    @pytest.mark.asyncio
    async def test_overlapping_batches(self, backend: StorageBackend) -> None:
        # What the storage tier does on one loop: writer tasks (exists, then put batches) beside
        # prefetch tasks (exists, get_into batches) and the removal of pages that failed checks.
        stored = {f"ob-{i}": random_bytes(2000 + i, seed=i) for i in range(32)}
        fresh = {f"ob-new-{i}": random_bytes(1000 + i, seed=100 + i) for i in range(32)}
        doomed = [f"ob-bad-{i}" for i in range(8)]
        assert await backend.put([*stored, *doomed], [*stored.values(), *[b"x"] * 8]) == [True] * 40

        async def write(keys: list[str]) -> None:
            assert await backend.exists(keys) == [False] * len(keys)
            assert await backend.put(keys, [fresh[k] for k in keys]) == [True] * len(keys)

        async def read(keys: list[str]) -> None:
            assert await backend.exists(keys) == [True] * len(keys)
            buffers = [bytearray(len(stored[k])) for k in keys]
            assert await backend.get_into(keys, buffers) == [len(stored[k]) for k in keys]
            assert [bytes(b) for b in buffers] == [stored[k] for k in keys]

        async def remove() -> None:
            assert await backend.delete(doomed) == [True] * len(doomed)

        batches = [list(keys)[lo : lo + 8] for keys in (stored, fresh) for lo in range(0, 32, 8)]
        reads = [read(b) for b in batches[:4] * 2]
        await asyncio.gather(*(write(b) for b in batches[4:]), *reads, remove())
        assert await backend.get(list(fresh)) == list(fresh.values())
        assert await backend.exists(doomed) == [False] * len(doomed)

    @pytest.mark.asyncio
    async def test_a_cancelled_read_leaves_the_buffer_alone(self, backend: StorageBackend) -> None:
        # The caller reuses its buffer once the call has ended, cancelled or not. A byte every
        # 64 KiB is sampled when the call ends: a copy still running would change some later.
        size = min(self.large_size(backend), 8 << 20)
        assert await backend.put(["cancel-r"], [np.full(size, 7, np.uint8)]) == [True]
        buf = np.zeros(size, np.uint8)
        call = asyncio.ensure_future(backend.get_into(["cancel-r"], [buf]))
        await asyncio.sleep(0)  # the read has started (a thread of the backend may hold buf)
        await _cancelled(call)
        sampled = buf[:: 1 << 16].copy()
        await asyncio.sleep(0.05)
        assert np.array_equal(buf[:: 1 << 16], sampled), "the buffer changed after the call"

    @pytest.mark.asyncio
    async def test_a_cancelled_put_is_whole_or_absent(self, backend: StorageBackend) -> None:
        size = min(self.large_size(backend), 8 << 20)
        old, new = np.full(size, 1, np.uint8), np.full(size, 2, np.uint8)
        assert await backend.put(["cancel-w"], [old]) == [True]
        call = asyncio.ensure_future(backend.put(["cancel-w"], [new]))
        await asyncio.sleep(0)
        await _cancelled(call)
        # The caller reuses its buffer, the end first (ahead of any copy still running): what
        # is stored must not change with it.
        new[:: -(1 << 16)] = 3
        new.fill(3)
        await asyncio.sleep(0.05)
        (got,) = await backend.get(["cancel-w"], size_hint=size)
        assert got in (old.tobytes(), np.full(size, 2, np.uint8).tobytes()), "a torn object"

    @pytest.mark.asyncio
    async def test_scan_while_putting_and_deleting(self, backend: StorageBackend) -> None:
        require_listable(backend)
        base = {f"base-{i}": random_bytes(50 + i, seed=i) for i in range(20)}
        gone = [f"gone-{i}" for i in range(20)]
        new = [f"new-{i}" for i in range(40)]
        assert await backend.put(list(base), list(base.values())) == [True] * 20
        assert await backend.put(gone, [b"g"] * 20) == [True] * 20

        async def churn() -> None:
            for i, key in enumerate(new):
                assert await backend.put([key], [b"n" * i]) == [True]
                if i < len(gone):
                    assert await backend.delete([gone[i]]) == [True]
                await asyncio.sleep(0)

        async def listing() -> list[ObjectInfo]:
            seen = []
            async for info in backend.scan(""):
                seen.append(info)
                await asyncio.sleep(0)
            return seen

        _, seen = await asyncio.gather(churn(), listing())
        keys = [info.key for info in seen]
        assert len(keys) == len(set(keys)), "scan listed a key twice"
        assert set(base) <= set(keys), "scan lost an object nobody touched"
        assert set(keys) <= set(base) | set(gone) | set(new), "scan listed a non-key"
        assert all(info.size == len(base[info.key]) for info in seen if info.key in base)

    @pytest.mark.asyncio
    async def test_persistence_across_reopen(
        self, backend: StorageBackend, location: pathlib.Path
    ) -> None:
        if not backend.capabilities.persistent:
            pytest.skip(f"{type(backend).__name__} is not persistent (capabilities)")
        value = random_bytes(5000, seed=7)
        assert await backend.put(["keep", "drop", "empty"], [b"old", b"x", b""]) == [True] * 3
        assert await backend.put(["keep"], [value]) == [True]
        assert await backend.delete(["drop"]) == [True]
        await backend.close()
        reopened = await self.open_backend(location)
        try:
            assert await reopened.exists(["keep", "drop", "empty"]) == [True, False, True]
            assert await reopened.get(["keep", "empty"]) == [value, b""]
            if reopened.capabilities.listable:
                listed = {info.key: info.size for info in await scan_all(reopened)}
                assert listed == {"keep": len(value), "empty": 0}
        finally:
            await reopened.close()

    @pytest.mark.asyncio
    async def test_stats_counters_move(self, backend: StorageBackend) -> None:
        before = await backend.stats()
        for name in ("get_hits", "get_misses", "get_too_small", "puts", "bytes_written"):
            assert isinstance(before[name], int), name
        assert await backend.put(["s1", "s2"], [b"a" * 10, b"b" * 20]) == [True, True]
        assert await backend.get_into(["s1", "nope"], [bytearray(10), bytearray(1)]) == [10, MISS]
        assert await backend.get_into(["s2"], [bytearray(5)]) == [20]
        assert await backend.delete(["s1", "nope"]) == [True, False]
        after = await backend.stats()
        moved = {name: after[name] - before[name] for name in before if name in after}
        expected = {"puts": 2, "bytes_written": 30, "get_hits": 1, "bytes_read": 10}
        expected |= {"get_misses": 1, "get_too_small": 1, "deletes": 1, "put_failures": 0}
        assert {name: moved.get(name) for name in expected} == expected

    @pytest.mark.slow  # 64 MiB by default
    @pytest.mark.asyncio
    async def test_large_object_round_trip(self, backend: StorageBackend) -> None:
        n = self.large_size(backend)  # the largest object the backend promises to take
        # Little-endian counters: every 4-byte word differs, so a shifted or repeated chunk shows.
        data = np.arange((n + 3) // 4, dtype="<u4").view(np.uint8)[:n]
        assert await backend.put(["large"], [data]) == [True]
        out = np.empty(n, dtype=np.uint8)
        assert await backend.get_into(["large"], [out]) == [n]
        for start in (0, n // 3, n // 2, max(n - 4096, 0)):
            assert np.array_equal(out[start : start + 4096], data[start : start + 4096]), start
        assert hashlib.blake2b(out.data).digest() == hashlib.blake2b(data.data).digest()
        if backend.capabilities.listable:
            assert {i.key: i.size for i in await scan_all(backend, "large")} == {"large": n}
        assert await backend.delete(["large"]) == [True]


async def _cancelled(call: asyncio.Future[Any]) -> None:
    """Cancel ``call`` and wait for it to end, whether the cancellation came in time or not."""
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
