"""Running ``hicache serve --http`` as a process in tests: start it, read where it listens, stop
it with SIGTERM and check how it ended."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SMALL = ["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim",
         "32", "--vocab", "256", "--device-tokens", "512"]  # fmt: skip


def serve_argv(*args: str) -> list[str]:
    """``hicache serve`` with a small seeded model and ``args``."""
    return [sys.executable, "-m", "hicache.tools.cli", "serve", *SMALL, *args]


@contextmanager
def listening(argv: list[str], last_words: str, stop_s: float = 90.0) -> Iterator[str]:
    """Run ``argv`` (a ``serve --http``), yield the URL it prints first; at the end SIGTERM it
    and check it exits 0 having said ``last_words`` on stderr. Killed if still running."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert " on http://" in line, (line, proc.stderr.read() if proc.stderr else "")
        yield line.rsplit(" ", 1)[1].strip()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=stop_s)
        assert proc.returncode == 0, err
        assert last_words in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
