"""The hand-kept package list in pyproject.toml names every package of the source tree."""

from __future__ import annotations

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for package, directory in config["package-dir"].items():
        base = ROOT / directory
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base).parts
            if not relative or all(part.isidentifier() for part in relative):
                found.add(".".join((package, *relative)))
    assert found - listed == set(), f"add to pyproject [tool.setuptools] packages: {found - listed}"
    assert "hicache.radix" in listed and "LICENSE" in (ROOT / "pyproject.toml").read_text()
