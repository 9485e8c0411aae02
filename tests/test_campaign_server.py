"""The hostile-client campaign (tests/campaign_server.py) runs clean: every refusal with its
status, no secret leaked, no cross-tenant hit, no crash."""

from __future__ import annotations

import pathlib
import subprocess
import sys

CAMPAIGN = pathlib.Path(__file__).with_name("campaign_server.py")


def test_the_campaign_finds_nothing() -> None:
    done = subprocess.run([sys.executable, str(CAMPAIGN), "--ttft-rounds", "1"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    counts = done.stdout.splitlines()[0]
    assert "secrets leaked 0, cross-tenant hits 0, crashes 0" in counts
    tried, right = counts.split(" of ")[0].rsplit(" ", 1)[1], counts.split(" of ")[1].split(",")[0]
    assert tried == right and int(right) >= 80, counts
