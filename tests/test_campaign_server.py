"""The hostile-client campaign (tests/campaign_server.py) runs clean in each of its modes (a
single server, a router over local workers, a router over remote https workers; TLS in all):
every refusal with its status, no secret leaked, no cross-tenant hit, no crash."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

CAMPAIGN = pathlib.Path(__file__).with_name("campaign_server.py")
MODES = ("single", "router", "remote")
# Refusals each mode plays at the least: about 210 with one hostile round (92 of them bob's).
MIN_REFUSALS = 150


def test_the_campaign_finds_nothing() -> None:
    # Small round counts: CI time is short, and the figures are not asserted here.
    argv = [sys.executable, str(CAMPAIGN), "--ttft-rounds", "1", "--hostile-rounds", "1",
            "--hostile-requests", "6"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    for mode in MODES:
        counts = next(
            (line for line in done.stdout.splitlines() if line.startswith(f"[{mode}] requests ")),
            None,
        )
        assert counts is not None, done.stdout
        assert "secrets leaked 0, cross-tenant hits 0, crashes 0" in counts
        found = re.search(r"refused with the right status (\d+) of (\d+),", counts)
        assert found is not None, counts
        right, expected = map(int, found.groups())
        assert right == expected and expected >= MIN_REFUSALS, counts
