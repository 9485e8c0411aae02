"""Running ``hicache serve --http`` as a process in tests: start it, read where it listens, stop
it with SIGTERM and check how it ended."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SMALL = ["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim",
         "32", "--vocab", "256", "--device-tokens", "512"]  # fmt: skip


def serve_argv(*args: str) -> list[str]:
    """``hicache serve`` with a small seeded model and ``args``."""
    return [sys.executable, "-m", "hicache.tools.cli", "serve", *SMALL, *args]


@dataclass
class Served:
    """A running ``serve --http``: its URL and process; its stderr once it stopped."""

    url: str
    process: subprocess.Popen[str]
    stderr: str = ""
    killed: bool = False  # by the test, on purpose: its exit is not checked

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.killed = True


@contextmanager
def serving(argv: list[str], stop_s: float = 90.0) -> Iterator[Served]:
    """Run ``argv`` (a ``serve --http``) until the block ends, then SIGTERM it and check it
    exits 0 (its stderr is kept), unless the block killed it (:meth:`Served.kill`). Killed
    if still running."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert " on http://" in line, (line, proc.stderr.read() if proc.stderr else "")
        served = Served(line.rsplit(" ", 1)[1].strip(), proc)
        yield served
        if not served.killed:
            proc.send_signal(signal.SIGTERM)
        _, served.stderr = proc.communicate(timeout=stop_s)
        assert served.killed or proc.returncode == 0, served.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextmanager
def listening(argv: list[str], last_words: str, stop_s: float = 90.0) -> Iterator[str]:
    """:func:`serving`, yielding the URL; it must have said ``last_words`` on stderr."""
    with serving(argv, stop_s) as served:
        yield served.url
    assert last_words in served.stderr, served.stderr
