"""SGLang integration tests: they run in the SGLang venv the Makefile builds (`make
test-sglang`) and skip elsewhere. SGLang imports torchvision at module level for its vision
models; where torchvision is not installed (the index's wheels are CUDA builds that would
replace the CPU torch) the stub in engines/stubs, which fails on any real use, stands in for it
(the SGLang venv has it on its path already)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

from redis_engine_kit import redis_server, redis_url  # noqa: F401 (fixtures)

if (
    importlib.util.find_spec("sglang") is not None
    and importlib.util.find_spec("torchvision") is None
):
    sys.path.insert(0, str(pathlib.Path(__file__).parents[3] / "engines" / "stubs"))
