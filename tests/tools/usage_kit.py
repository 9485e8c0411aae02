"""What a usage error of ``hicache`` looks like on stderr, for the CLI tests of tests/tools. A
plain module (not conftest) so that test modules can import it by name."""

from __future__ import annotations


def usage_error(err: str) -> str:
    """The one error line after argparse's usage, checking there is nothing else."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), err
    assert lines[-1].startswith("hicache") and ": error: " in lines[-1], err
    return lines[-1]
