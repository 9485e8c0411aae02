"""The parts of ``bench vllm-serve`` that need no vLLM: the device-read floor and the trace's
geometry (the bench itself starts vLLM several times: a command, not a test)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from hicache.tools.bench.engines.vllm_process import (
    BLOCK_TOKENS,
    kv_bytes_per_token,
    write_checkpoint,
)
from hicache.tools.bench.engines.vllm_serve import _trace_geometry, device_read_s


def test_the_floor_reads_the_bytes_asked_for_across_files(tmp_path: Path) -> None:
    files = []
    for i in range(3):
        path = tmp_path / f"seg{i}"
        path.write_bytes(bytes([i]) * (1 << 20))
        files.append(path)
    seconds = device_read_s(files, (2 << 20) + 4096)
    assert math.isnan(seconds) or 0 < seconds < 60


def test_the_trace_fits_the_working_set_ratio() -> None:
    args = argparse.Namespace(conversations=8, turns=4, working_set_ratio=4)
    blocks, longest = _trace_geometry(args)
    working_set = 1024 + 8 * (longest - 1024)
    assert longest == 1024 + 4 * (256 + 16)
    assert blocks * BLOCK_TOKENS * 4 <= working_set < (blocks + 1) * BLOCK_TOKENS * 4
    assert blocks * BLOCK_TOKENS > longest  # one conversation still fits


def test_kv_bytes_follow_the_checkpoint(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m", hidden=128, layers=2)
    # 2 layers x (K, V) x 2 KV heads x 32 dims x 2 bytes
    assert kv_bytes_per_token(model) == 2 * 2 * 2 * 32 * 2
