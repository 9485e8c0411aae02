"""Helpers for the shm backend's tests: segment names, small segments, child processes.

Fixtures are plain functions here; a test module makes them fixtures with
``name = pytest.fixture(fresh_name, name="name")``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from hicache.backends.shm import SharedMemoryBackend, SharedMemoryConfig

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
KIB = 1 << 10
MIB = 1 << 20


def fresh_name() -> Iterator[str]:
    """A fresh segment name, unlinked afterwards whatever the test did."""
    value = f"test-{uuid.uuid4().hex[:16]}"
    yield value
    SharedMemoryBackend.unlink_segment(value, SHM_DIR)


def shm_config(name: str, **fields: Any) -> SharedMemoryConfig:
    values: dict[str, Any] = {"capacity_bytes": 4 * MIB, "block_bytes": 64 * KIB}
    values.update(fields)
    return SharedMemoryConfig(name=name, directory=SHM_DIR, **values)


async def opened_small(name: str) -> AsyncIterator[SharedMemoryBackend]:
    """A 4 MiB segment of 64 KiB blocks."""
    backend = await SharedMemoryBackend.open(shm_config(name))
    yield backend
    await backend.close()


_CHILD_PRELUDE = """
import asyncio, os, signal, sys
import numpy as np
from hicache.backends.shm import SharedMemoryBackend, SharedMemoryConfig
NAME, DIRECTORY = sys.argv[1], sys.argv[2]
def config():
    return SharedMemoryConfig(name=NAME, directory=DIRECTORY)
"""


def run_child(body: str, name: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    code = _CHILD_PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code, name, SHM_DIR],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def pattern(i: int, size: int) -> bytes:
    return bytes([i % 251]) * size
