"""``hicache serve --http HOST:PORT``: the engine behind an OpenAI-compatible endpoint.

One configuration (device + host + L3 by default, as without ``--http``), served until SIGINT or
SIGTERM, then drained (see :mod:`hicache.server.app`). L3 uses the model's own
namespace, shared across restarts: its name carries a fingerprint of the weights, so another
checkpoint (or seed) of the same shapes never reads these pages.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from hicache.errors import BackendError, InvalidArgumentError
from hicache.models.byte_tokenizer import ByteTokenizer
from hicache.models.config import ModelConfig
from hicache.models.hf.fingerprint import checkpoint_fingerprint, config_fingerprint
from hicache.models.hf.loader import CheckpointPlan
from hicache.models.hf.tokenizer import load_tokenizer
from hicache.models.types import ServingModel
from hicache.server.app import HttpServer, Listen
from hicache.server.auth import Access
from hicache.server.chat import load_chat_template
from hicache.server.limits import Limits
from hicache.server.request_body import ChatTemplate, ServedModel
from hicache.serving.engine import CacheMode
from hicache.serving.setup import open_engine
from hicache.tiering.common.config import HiCacheConfig, StorageConfig
from hicache.tools.cli_parsing import CommandFailed
from hicache.tools.serve.config import engine_config_of, hisparse_config

__all__ = [
    "Background",
    "model_identity",
    "parse_listen",
    "run_http",
    "running",
    "served_model",
    "serving_mode",
]

# A task the server runs beside itself for its whole life (a service it keeps alive).
Background = Callable[[], Coroutine[Any, Any, None]]

_DEFAULT_MODEL_ID = StorageConfig().model_id


def parse_listen(text: str) -> Listen:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgumentError(
            f"--http wants HOST:PORT (for example 127.0.0.1:8000), got {text!r}"
        )
    return Listen(host.strip("[]"), int(port))


def serving_mode(hicache: HiCacheConfig) -> CacheMode:
    """The one configuration a server runs: its tiers as the flags give them."""
    if not hicache.tiers.host_enabled:
        return CacheMode.DEVICE
    return CacheMode.DEVICE_HOST if hicache.storage.url is None else CacheMode.DEVICE_HOST_L3


def model_identity(model: ModelConfig, plan: CheckpointPlan | None) -> tuple[str, str]:
    """(the name clients use, the L3 model id: the name and a fingerprint of the weights)."""
    if plan is not None:
        name = plan.directory.resolve().name or "model"
        files = set(plan.files.file_of.values())
        return name, f"{name}-{checkpoint_fingerprint(plan.directory, files)}"
    name = f"hicache-{model.preset.value}"
    return name, f"{name}-{config_fingerprint(dataclasses.asdict(model))}"


def served_model(
    name: str, config: ModelConfig, plan: CheckpointPlan | None, context_tokens: int | None = None
) -> ServedModel:
    """What the endpoint serves: a checkpoint's tokenizer and chat template, or for a seeded
    preset text as UTF-8 bytes and the plain template; ``context_tokens``: the most prompt
    tokens the engine takes (its device pool), None to leave that to the engine."""
    if plan is not None:
        tokenizer, chat = load_tokenizer(plan.directory), load_chat_template(plan.directory)
    else:
        tokenizer, chat = ByteTokenizer(), ChatTemplate()
    return ServedModel(name, config.vocab_size, tokenizer, chat, context_tokens)


def run_http(
    args: argparse.Namespace,
    hicache: HiCacheConfig,
    model: ServingModel,
    plan: CheckpointPlan | None,
    background: Sequence[Background] = (),
    rules: tuple[Access, Limits] | None = None,
) -> int:
    """Serve until a signal; 0 after a clean drain."""
    name, model_id = model_identity(model.config, plan)
    if hicache.storage.url is not None and hicache.storage.model_id == _DEFAULT_MODEL_ID:
        hicache = hicache.with_changes("storage", model_id=model_id)
    served = served_model(name, model.config, plan, args.device_tokens)
    asyncio.run(_serve(args, hicache, model, served, background, rules or (Access(), Limits())))
    return 0


async def _serve(
    args: argparse.Namespace,
    hicache: HiCacheConfig,
    model: ServingModel,
    served: ServedModel,
    background: Sequence[Background],
    rules: tuple[Access, Limits],
) -> None:
    mode = serving_mode(hicache)
    engine_config = engine_config_of(args, hisparse_config(args))
    try:
        setup = await open_engine(model, mode, hicache, args.device_tokens, engine_config)
    except BackendError as exc:
        raise CommandFailed(str(exc)) from exc
    access, limits = rules
    server = HttpServer(setup, served, args.http, access, limits)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    loop.add_signal_handler(signal.SIGHUP, access.keys.reload)

    def ready(url: str) -> None:
        print(f"serving {served.name} ({mode.value}) on {url}", flush=True)

    async with running(background):
        await server.serve(ready)
    print("drained; stopped", file=sys.stderr, flush=True)


@contextlib.asynccontextmanager
async def running(background: Sequence[Background]) -> AsyncIterator[None]:
    """The ``background`` tasks run for the block, cancelled after it."""
    tasks = [asyncio.create_task(job()) for job in background]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
