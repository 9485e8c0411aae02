"""The adapter's event loop in a thread of its own (hicache.integrations.sync_loop).

SGLang calls storage from plain threads; every call must come back with its own result or
error, a stuck call must be cancelled (not left running), and a closed loop must refuse calls
without leaking the coroutine it was handed. No assertion depends on how fast anything runs:
waits are on events, with bounds far above what a loaded machine needs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import threading
import warnings
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from hicache.errors import BackendClosedError, BackendUnavailableError
from hicache.integrations.sync_loop import SyncLoop

GENEROUS_S = 10.0  # a bound that only a hang reaches
_NAMES = itertools.count()


def _unique_name() -> str:
    return f"test-sync-loop-{next(_NAMES)}"


def _thread_named(name: str) -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == name), None)


async def _value(value: object) -> object:
    await asyncio.sleep(0)  # a real suspension: the result crosses a loop iteration
    return value


def _unawaited_warnings(action: Callable[[], None]) -> list[warnings.WarningMessage]:
    """The "coroutine ... was never awaited" warnings raised while running ``action``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
        gc.collect()  # the warning comes when an unstarted coroutine is collected
    return [w for w in caught if "was never awaited" in str(w.message)]


@pytest.fixture
def loop() -> Iterator[SyncLoop]:
    sync = SyncLoop(_unique_name())
    yield sync
    sync.close(timeout_s=GENEROUS_S)


# ----- results and errors -------------------------------------------------------------------
def test_run_returns_the_result_computed_on_the_loop_thread(loop: SyncLoop) -> None:
    async def where() -> str:
        await asyncio.sleep(0)
        return threading.current_thread().name

    name = loop.run(where(), timeout_s=GENEROUS_S)
    assert name != threading.current_thread().name
    thread = _thread_named(name)
    # A daemon: an engine that never closes the adapter can still exit.
    assert thread is not None and thread.daemon


def test_run_reraises_the_coroutines_own_exception(loop: SyncLoop) -> None:
    error = KeyError("missing page")

    async def fails() -> None:
        await asyncio.sleep(0)
        raise error

    with pytest.raises(KeyError) as caught:
        loop.run(fails(), timeout_s=GENEROUS_S)
    assert caught.value is error


def test_a_timeout_cancels_the_coroutine(loop: SyncLoop) -> None:
    started = threading.Event()
    cancelled = threading.Event()

    async def stuck() -> None:
        never = asyncio.Event()
        started.set()
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(BackendUnavailableError):
        loop.run(stuck(), timeout_s=0.2)
    assert started.is_set()
    # The cancellation reaches the coroutine on the loop's next turn: wait for it, not a time.
    assert cancelled.wait(GENEROUS_S)
    # The loop is not wedged by the cancelled call.
    assert loop.run(_value(7), timeout_s=GENEROUS_S) == 7


def test_run_from_the_loop_thread_raises_instead_of_deadlocking(loop: SyncLoop) -> None:
    async def reenter() -> str:
        inner = _value(1)
        try:
            with pytest.raises(RuntimeError, match="own loop thread"):
                # Timeout only so that a regression fails instead of hanging the loop.
                loop.run(inner, timeout_s=1.0)  # type: ignore[arg-type]
        finally:
            inner.close()  # the refused coroutine is the caller's to close here
        return "refused"

    assert loop.run(reenter(), timeout_s=GENEROUS_S) == "refused"


def test_concurrent_callers_each_get_their_own_result(loop: SyncLoop) -> None:
    callers = 8
    gate: asyncio.Event = loop.run(_make_event(), timeout_s=GENEROUS_S)
    arrived = 0

    async def rendezvous(index: int) -> tuple[int, str]:
        # Every call waits until all are in flight at once: calls really overlap.
        nonlocal arrived
        arrived += 1
        if arrived == callers:
            gate.set()
        await gate.wait()
        return index, f"page-{index}"

    def call(index: int) -> tuple[int, str]:
        return loop.run(rendezvous(index), timeout_s=GENEROUS_S)

    with concurrent.futures.ThreadPoolExecutor(callers) as pool:
        results = list(pool.map(call, range(callers)))
    assert results == [(i, f"page-{i}") for i in range(callers)]


async def _make_event() -> asyncio.Event:
    return asyncio.Event()  # made on the loop that will wait on it


# ----- close --------------------------------------------------------------------------------
def test_close_runs_hooks_in_reverse_order_on_the_loop_once() -> None:
    name = _unique_name()
    sync = SyncLoop(name)
    order: list[tuple[str, str]] = []

    def hook(tag: str) -> Callable[[], Coroutine[Any, Any, None]]:
        async def closer() -> None:
            order.append((tag, threading.current_thread().name))

        return closer

    sync.on_close(hook("backend"))
    sync.on_close(hook("wrapper"))
    assert not sync.closed
    sync.close(timeout_s=GENEROUS_S)
    sync.close(timeout_s=GENEROUS_S)  # idempotent: hooks do not run twice
    # Last registered closes first, as a stack of wrappers unwinds.
    assert order == [("wrapper", name), ("backend", name)]
    assert sync.closed
    assert _thread_named(name) is None


def test_a_failing_hook_still_closes_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    name = _unique_name()
    sync = SyncLoop(name)
    ran: list[str] = []

    async def fine() -> None:
        ran.append("fine")

    async def broken() -> None:
        raise OSError("backend close failed")

    sync.on_close(fine)
    sync.on_close(broken)  # runs first (reverse order) and must not skip the other
    sync.close(timeout_s=GENEROUS_S)
    assert ran == ["fine"]
    assert "close hook" in caplog.text and "backend close failed" in caplog.text
    assert sync.closed
    assert _thread_named(name) is None
    sync.close(timeout_s=GENEROUS_S)  # and a second close is quiet


def test_run_after_close_raises_and_closes_the_coroutine() -> None:
    sync = SyncLoop(_unique_name())
    sync.close(timeout_s=GENEROUS_S)

    def refused_call() -> None:
        coro = _value(1)
        with pytest.raises(BackendClosedError):
            sync.run(coro, timeout_s=GENEROUS_S)
        assert coro.cr_frame is None  # closed, never started

    assert _unawaited_warnings(refused_call) == []


def test_the_unawaited_check_sees_a_leaked_coroutine() -> None:
    # Guards the test above: a coroutine dropped unclosed must be caught by the same check.
    def leak() -> None:
        _value(1)

    assert len(_unawaited_warnings(leak)) == 1
