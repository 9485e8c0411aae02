"""Running the ``hicache`` command in the test process, for the CLI tests of every package."""

from __future__ import annotations

import pytest

from hicache.tools.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``hicache *argv`` in this process: exit status, stdout, stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
