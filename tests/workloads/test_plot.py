"""``hicache serve --plot``: a PNG of TTFT per round, one line per configuration."""

from __future__ import annotations

import pathlib

import pytest

from hicache.workloads.plot import plot_rounds


def test_plot_writes_a_png(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    rows = [
        {"name": "none", "rounds_ttft_ms": [120.0, 240.0, 300.0]},
        {"name": "device+host+l3", "rounds_ttft_ms": [110.0, 40.0, 35.0]},
    ]
    out = tmp_path / "ttft.png"
    plot_rounds(rows, str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
