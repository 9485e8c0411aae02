"""Engine worker processes behind a router: each one a ``hicache serve --http`` of its own.

A worker is started with the router's own command line less the router's flags, listening on a
free port of 127.0.0.1; it reports its URL on its first line of output. Its later output goes to
the router's stderr line by line, prefixed with its index. On a machine with several CUDA
devices each worker sees one; on a CPU each gets an equal share of the cores for torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache.errors import HiCacheError

__all__ = [
    "L3_ENV",
    "RemoteWorker",
    "Worker",
    "WorkerProcess",
    "WorkerStartError",
    "start_workers",
    "worker_argv",
]

# The router's flags, each taking one value, then those without one: a worker listens on
# loopback for the router alone, which checks keys and per-caller limits itself. ``--l3`` goes
# to a worker in its environment (L3_ENV), never on its command line, where any user of the
# machine could read the URL's credentials.
_ROUTER_FLAGS = (
    "--http", "--workers", "--router", "--api-key", "--api-keys", "--admin-api-key",
    "--admin-api-key-file", "--rate-limit", "--max-concurrent", "--max-priority", "--l3-allow",
    "--ssl-certfile", "--ssl-keyfile", "--internal-token-file", "--worker", "--worker-ca-file",
    "--max-connections-per-client", "--l3",
)  # fmt: skip
_ROUTER_SWITCHES = ("--insecure-no-auth", "--metrics-public")
_START_TIMEOUT_S = 300.0  # loading a checkpoint can take minutes
_STOP_TIMEOUT_S = 60.0
L3_ENV = "HICACHE_L3_URL"  # ``serve``'s --l3 when the flag is not given
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WorkerStartError(HiCacheError):
    """A worker exited or said nothing before it listened; its last error line is quoted."""


def worker_argv(argv: Sequence[str], token_file: str | None = None) -> list[str]:
    """A ``serve`` command line for one worker: ``argv`` less the router's flags (``--flag V``
    and ``--flag=V`` forms), listening on a free port of 127.0.0.1; ``token_file``: the
    router's internal token, the only key the worker takes."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _ROUTER_SWITCHES:
            continue
        if name in _ROUTER_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    token = ("--internal-token-file", token_file) if token_file is not None else ()
    return [*out, "--http", "127.0.0.1:0", *token]


@dataclass(eq=False)
class WorkerProcess:
    """One running worker: its index, process and URL, and how to start it again."""

    index: int
    process: asyncio.subprocess.Process
    url: str
    command: list[str] = field(default_factory=list, repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    _relay: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def restartable(self) -> bool:
        return True

    def ended(self) -> str:
        """Why it is gone, for the log."""
        return f"exited (status {self.process.returncode})"

    async def restart(self) -> None:
        """Start it again (a new process on a new port); WorkerStartError if it fails."""
        if self._relay is not None:
            await self._relay
        again = await _start(self.index, self.command, self.env)
        self.process, self.url, self._relay = again.process, again.url, again._relay

    async def stop(self) -> int | None:
        """SIGTERM (the worker drains), then SIGKILL past the timeout; its exit status."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), _STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        if self._relay is not None:
            await self._relay
        return self.process.returncode


@dataclass(eq=False)
class RemoteWorker:
    """A worker started elsewhere (``serve --http ... --internal-token-file FILE``), known by
    its URL (``http://`` or ``https://``); the router's health checks decide whether requests
    go to it."""

    index: int
    url: str

    @property
    def alive(self) -> bool:
        return True  # not the router's process: only its answers tell

    @property
    def pid(self) -> int | None:
        return None

    @property
    def restartable(self) -> bool:
        return False

    def ended(self) -> str:
        return "stopped answering"

    async def restart(self) -> None:
        return None  # its own operator restarts it

    async def stop(self) -> int | None:
        return None  # its own operator stops it


Worker = WorkerProcess | RemoteWorker


async def start_workers(
    argv: Sequence[str], count: int, gpus: int, l3: str | None = None, token_file: str | None = None
) -> list[WorkerProcess]:
    """Start ``count`` workers of the ``serve`` command line ``argv`` (see :func:`worker_argv`);
    ``gpus``: CUDA devices to spread them over (0: the CPU's cores are shared out instead);
    ``l3``: the L3 URL they use (in their environment). Each is listening when this returns;
    if any fails, the others are stopped and its :class:`WorkerStartError` raised."""
    command = worker_argv(argv, token_file)
    results = await asyncio.gather(
        *(_start(i, command, _env(i, count, gpus, l3)) for i in range(count)),
        return_exceptions=True,
    )
    started = [r for r in results if isinstance(r, WorkerProcess)]
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await asyncio.gather(*(w.stop() for w in started), return_exceptions=True)
        raise failures[0]
    return started


async def _start(index: int, command: list[str], env: dict[str, str]) -> WorkerProcess:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hicache.tools.cli", *command,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        preexec_fn=_die_with_parent,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    try:
        first = await asyncio.wait_for(process.stdout.readline(), _START_TIMEOUT_S)
    except TimeoutError:
        first = b""
    except BaseException:  # cancelled mid-start (the router stopping): no orphan left
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await asyncio.shield(process.wait())
        raise
    text = first.decode(errors="replace").strip()
    if " on http://" in text:
        relay = asyncio.create_task(_relay(index, process))
        return WorkerProcess(index, process, text.rsplit(" ", 1)[1], command, env, relay)
    if process.returncode is None:
        process.kill()
    errors = (await process.stderr.read()).decode(errors="replace").strip().splitlines()
    await process.wait()
    last = errors[-1] if errors else f"exit status {process.returncode}"
    raise WorkerStartError(f"worker {index} failed to start: {last}")


# libc's symbols, looked up here: the child between fork and exec may not load anything.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In the worker, before it runs: SIGTERM it when the router dies, however the router
    dies (a SIGKILL gives the router no chance to stop it)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


async def _relay(index: int, process: asyncio.subprocess.Process) -> None:
    """Copy the worker's output to ours, each line prefixed with its index, until it exits."""

    async def copy(stream: asyncio.StreamReader | None) -> None:
        while stream is not None and (line := await stream.readline()):
            text = line.decode(errors="replace").rstrip()
            print(f"[worker {index}] {text}", file=sys.stderr, flush=True)

    await asyncio.gather(copy(process.stdout), copy(process.stderr))


def _env(index: int, count: int, gpus: int, l3: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(L3_ENV, None)
    if l3 is not None:
        env[L3_ENV] = l3
    if gpus > 0:
        visible = env.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
        env["CUDA_VISIBLE_DEVICES"] = visible[index % len(visible)]
    else:  # N processes of torch each with every core would fight over them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // count))
    return env
