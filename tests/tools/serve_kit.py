"""Running ``hicache serve --http`` as a process in tests: start it, read where it listens, stop
it with SIGTERM and check how it ended."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

SMALL = ["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim",
         "32", "--vocab", "256", "--device-tokens", "512"]  # fmt: skip


def serve_argv(*args: str) -> list[str]:
    """``hicache serve`` with a small seeded model and ``args``."""
    return [sys.executable, "-m", "hicache.tools.cli", "serve", *SMALL, *args]


@dataclass
class Served:
    """A running ``serve --http``: its URL and process; its stderr as it comes (``lines``), and
    whole once it stopped (``stderr``)."""

    url: str
    process: subprocess.Popen[str]
    stderr: str = ""
    killed: bool = False  # by the test, on purpose: its exit is not checked
    lines: list[str] = field(default_factory=list)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.killed = True

    def said(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        """The first stderr line so far matching ``pattern`` (waited for)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            assert time.monotonic() < deadline, (pattern, self.lines[-5:])
            time.sleep(0.05)

    def worker_pid(self, index: int) -> int:
        """A router's worker's pid, from the router's log (the latest start of it)."""
        pattern = rf"worker {index} (?:at \S+ \(pid (\d+)\)|started again \(pid (\d+)\))"
        self.said(pattern)
        found = [m for line in list(self.lines) if (m := re.search(pattern, line))]
        return int(found[-1].group(1) or found[-1].group(2))

    def worker_url(self, index: int) -> str:
        return self.said(rf"worker {index} at (\S+)").group(1)


@contextmanager
def serving(argv: list[str], stop_s: float = 90.0) -> Iterator[Served]:
    """Run ``argv`` (a ``serve --http``) until the block ends, then SIGTERM it and check it
    exits 0 (its stderr is kept), unless the block killed it (:meth:`Served.kill`). Killed
    if still running."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")))
    reader.start()  # stderr read as it comes: a full pipe would stall the server
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert " on http" in line, (line, proc.wait(30), "".join(lines))
        served = Served(line.rsplit(" ", 1)[1].strip(), proc, lines=lines)
        yield served
        if not served.killed:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=stop_s)
        reader.join(timeout=30)
        served.stderr = "".join(lines)
        assert served.killed or proc.returncode == 0, served.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=30)


@contextmanager
def listening(argv: list[str], last_words: str, stop_s: float = 90.0) -> Iterator[str]:
    """:func:`serving`, yielding the URL; it must have said ``last_words`` on stderr."""
    with serving(argv, stop_s) as served:
        yield served.url
    assert last_words in served.stderr, served.stderr
