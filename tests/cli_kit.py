"""Running the ``hicache`` command, in the test process or in a fresh one, for the CLI tests of
every package."""

from __future__ import annotations

import subprocess
import sys

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


def run_without(package: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``hicache *argv`` in a fresh interpreter where ``package`` cannot be imported, as where
    an engine's venv is not the one running."""
    code = (
        f"import sys; sys.modules[{package!r}] = None; "
        "from hicache.tools.cli import main; sys.exit(main())"
    )
    command = [sys.executable, "-c", code, *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
