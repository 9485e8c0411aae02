"""The forward thread takes the caller's torch threads while it runs; the caller gets them back."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from hicache.serving.forward_thread import forward_executor, openmp_pause


def _count_in_new_thread() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_forward_thread_computes_with_the_callers_threads_and_the_caller_with_one() -> None:
    before = torch.get_num_threads()
    with forward_executor() as pool:
        assert pool.submit(torch.get_num_threads).result() == before
        assert torch.get_num_threads() == 1
        # A thread started meanwhile (an I/O pool's) computes on one thread as well.
        assert _count_in_new_thread() == 1
        # The forward thread keeps its count whatever the caller does with its own.
        torch.set_num_threads(1)
        assert pool.submit(torch.get_num_threads).result() == before
    assert torch.get_num_threads() == before


def test_nested_forward_threads_give_the_count_back_once_the_last_ends() -> None:
    before = torch.get_num_threads()
    with forward_executor() as outer:
        with forward_executor() as inner:
            assert inner.submit(torch.get_num_threads).result() == before
            assert outer.submit(torch.get_num_threads).result() == before
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_the_callers_count_comes_back_when_the_body_raises() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"), forward_executor():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_each_thread_keeps_its_own_count() -> None:
    """Two event loops in two threads, each with its forward thread: neither narrows the
    other's count, and each gets its own back."""
    before = torch.get_num_threads()
    results: dict[str, tuple[int, int, int]] = {}
    barrier = threading.Barrier(2)

    def serve(name: str, threads: int) -> None:
        torch.get_num_threads()
        torch.set_num_threads(threads)
        with forward_executor() as pool:
            barrier.wait()
            inside = (pool.submit(torch.get_num_threads).result(), torch.get_num_threads())
            barrier.wait()
        results[name] = (*inside, torch.get_num_threads())

    workers = [threading.Thread(target=serve, args=(n, t)) for n, t in (("a", 3), ("b", 2))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert results == {"a": (3, 1, 3), "b": (2, 1, 2)}
    torch.set_num_threads(before)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(openmp_pause() is None, reason="torch does not run on GNU OpenMP here")
def test_pause_releases_the_calling_threads_idle_team() -> None:
    pause = openmp_pause()
    assert pause is not None
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of two: the caller and one OpenMP thread
    try:
        torch.ones(1 << 22, dtype=torch.float64).sum()  # big enough to run on the team
        with_team = _threads()
        assert pause(1) == 0
        deadline = time.monotonic() + 5.0
        while _threads() >= with_team and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _threads() < with_team
        # The runtime still works: the next parallel op builds a team again.
        assert float(torch.ones(1 << 22, dtype=torch.float64).sum()) == float(1 << 22)
    finally:
        torch.set_num_threads(before)
