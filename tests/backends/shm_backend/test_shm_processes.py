"""The shm backend with several processes on one segment: sharing, dead writers, torn reads.

Child processes are started with ``sys.executable -c`` (a fresh interpreter, like spawn) and
talk back through their exit status and stdout.
"""

from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest
import pytest_asyncio
from shm_kit import KIB, MIB, fresh_name, opened_small, pattern, run_child, shm_config

import hicache.backends.shm.backend as shm_module
import hicache.backends.shm.layout as shm_layout
from hicache.backends.base import MISS
from hicache.backends.shm import SharedMemoryBackend
from hicache.backends.shm.index import key_hash
from hicache.backends.shm.layout import Hdr

name = pytest.fixture(fresh_name, name="name")
small = pytest_asyncio.fixture(opened_small, name="small")


# ----- sharing across processes -------------------------------------------------------------------
async def test_another_process_sees_objects_both_ways(small: SharedMemoryBackend) -> None:
    assert await small.put(["from-parent"], [pattern(1, 100 * KIB)]) == [True]
    child = run_child(
        """
        async def main():
            backend = await SharedMemoryBackend.open(config())
            got = await backend.get(["from-parent"])
            assert got == [bytes([1]) * (100 << 10)], "the child does not see the parent's put"
            assert await backend.put(["from-child"], [b"child!" * 1000]) == [True]
            print(sorted([i.key async for i in backend.scan("")]))
            await backend.close()
        asyncio.run(main())
        """,
        small.config.name,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "['from-child', 'from-parent']"
    assert await small.get(["from-child"]) == [b"child!" * 1000]
    assert (await small.stats())["objects"] == 2


async def test_second_instance_in_one_process_shares(small: SharedMemoryBackend) -> None:
    other = await SharedMemoryBackend.open(shm_config(small.config.name, capacity_bytes=None))
    try:
        assert await small.put(["k"], [b"v1"]) == [True]
        assert await other.get(["k"]) == [b"v1"]
        assert await other.delete(["k"]) == [True]
        assert await small.exists(["k"]) == [False]
    finally:
        await other.close()


# ----- dead writers -----------------------------------------------------------------------------
def kill_a_writer_before_publishing(name: str, put_args: str = '["doomed"], [bytes(100)]') -> None:
    """A child process puts ``put_args`` (Python source), copies every byte and is killed
    before publishing (the before_publish test hook)."""
    child = run_child(
        f"""
        async def main():
            backend = await SharedMemoryBackend.open(config())
            backend.before_publish = lambda keys: os.kill(os.getpid(), signal.SIGKILL)
            await backend.put({put_args})
        asyncio.run(main())
        """,
        name,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr


async def test_writer_killed_before_publishing_leaves_nothing_readable(
    small: SharedMemoryBackend,
) -> None:
    assert await small.put(["victim"], [pattern(7, 64 * KIB)]) == [True]
    # The child overwrites "victim" and adds "new", copies every byte, then dies before
    # publishing (the before_publish test hook).
    kill_a_writer_before_publishing(
        small.config.name, '["victim", "new"], [bytes([9]) * (64 << 10), bytes(3 << 20)]'
    )
    assert await small.exists(["victim", "new"]) == [True, False]
    assert await small.get(["victim"]) == [pattern(7, 64 * KIB)]  # the old, whole value
    stats = await small.stats()
    assert stats["writing"] == 2
    assert stats["free_bytes"] == 4 * MIB - 64 * KIB - (64 * KIB + 3 * MIB)
    # A writer short of space reclaims the dead reservation before evicting anything.
    assert await small.put(["fits-now"], [bytes(2 * MIB)]) == [True]
    stats = await small.stats()
    assert (stats["writing"], stats["reclaimed_dead_writes"], stats["evictions"]) == (0, 2, 0)
    assert await small.exists(["victim", "fits-now"]) == [True, True]


async def test_reclaim_on_open_and_live_writers_are_kept(small: SharedMemoryBackend) -> None:
    index = small._index
    with index.locked():
        mine = index.reserve(b"in-flight", key_hash(b"in-flight"), 64 * KIB)  # alive: ours
    assert mine is not None
    kill_a_writer_before_publishing(small.config.name)
    assert (await small.stats())["writing"] == 2
    assert await small.reclaim_dead_writes() == 1  # the child's, not ours
    with index.locked():
        assert index.publish(mine)
    assert await small.exists(["in-flight", "doomed"]) == [True, False]


async def test_dead_writer_found_by_pid_without_ofd_locks(
    small: SharedMemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where OFD locks do not exist (not Linux), liveness falls back to the recorded pid.
    monkeypatch.setattr(shm_layout, "_OFD", False)
    kill_a_writer_before_publishing(small.config.name)
    assert await small.reclaim_dead_writes() == 1
    assert (await small.stats())["free_bytes"] == 4 * MIB


async def test_writer_dying_inside_the_lock_is_repaired(small: SharedMemoryBackend) -> None:
    assert await small.put(["a", "b"], [b"x" * 100, b"y" * 200]) == [True, True]
    with small._index.locked():
        pending = small._index.reserve(b"pending", key_hash(b"pending"), 100 * KIB)
    assert pending is not None
    # As if a process had died between two writes of an index update.
    small._segment.header[Hdr.DIRTY] = 1
    stats = await small.stats()  # the next locker repairs first
    assert (stats["objects"], stats["used_bytes"], stats["writing"]) == (0, 0, 1)
    assert stats["free_bytes"] == 4 * MIB - 128 * KIB  # only the live reservation holds blocks
    assert await small.exists(["a", "b"]) == [False, False]
    with small._index.locked():
        assert small._index.publish(pending)  # a live writer's reservation survived
    assert await small.put(["c"], [b"z" * 10]) == [True]
    assert await small.exists(["a", "b", "c", "pending"]) == [False, False, True, True]


# ----- torn reads -------------------------------------------------------------------------------
@pytest.mark.parametrize("interfered_rounds", [1, 2])
async def test_reads_overlapping_a_reuse_of_their_blocks_are_redone(
    small: SharedMemoryBackend, monkeypatch: pytest.MonkeyPatch, interfered_rounds: int
) -> None:
    size = 1 * MIB
    assert await small.put(["shared"], [pattern(1, size)]) == [True]
    writer = await SharedMemoryBackend.open(shm_config(small.config.name, capacity_bytes=None))
    real_run = shm_module.run_copies
    state = {"rounds": 0, "next": 2, "inside": False}

    def run_with_interference(plan: list[tuple[np.ndarray, np.ndarray]]) -> None:
        if not state["inside"]:
            state["rounds"] += 1
            if state["rounds"] <= interfered_rounds:
                # Between the reader's lookup and its copy, another writer overwrites the key
                # twice: the second version lands in the blocks the reader is about to copy.
                state["inside"] = True
                for _ in range(2):
                    writer._put_sync(["shared"], [[memoryview(pattern(state["next"], size))]])
                    state["next"] += 1
                state["inside"] = False
        real_run(plan)

    monkeypatch.setattr(shm_module, "run_copies", run_with_interference)
    try:
        buf = bytearray(size)
        assert await small.get_into(["shared"], [buf]) == [size]
        # Never a mix: the version current at the last round (with two interfered rounds,
        # the third copies under the lock).
        assert bytes(buf) == pattern(1 + 2 * interfered_rounds, size)
        assert (await small.stats())["torn_read_retries"] == interfered_rounds
    finally:
        await writer.close()


async def test_concurrent_processes_never_see_torn_objects(name: str) -> None:
    size, rounds = 512 * KIB, 150
    backend = await SharedMemoryBackend.open(shm_config(name, capacity_bytes=2 * MIB))
    try:
        assert await backend.put(["hot"], [pattern(0, size)]) == [True]
        writer = asyncio.create_task(
            asyncio.to_thread(
                run_child,
                f"""
                async def main():
                    backend = await SharedMemoryBackend.open(config())
                    for i in range(1, {rounds} + 1):
                        assert await backend.put(["hot"], [bytes([i % 251]) * {size}]) == [True]
                    await backend.close()
                asyncio.run(main())
                """,
                name,
            )
        )
        buf = np.empty(size, np.uint8)
        hits = 0
        while not writer.done():
            (n,) = await backend.get_into(["hot"], [buf])
            if n != MISS:
                assert n == size
                assert (buf == buf[0]).all(), "a torn object was returned"
                hits += 1
        child = await writer
        assert child.returncode == 0, child.stderr
        assert hits > 0
        assert await backend.get(["hot"]) == [pattern(rounds, size)]
    finally:
        await backend.close()
