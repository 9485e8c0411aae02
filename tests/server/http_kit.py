"""A real ``HttpServer`` on a free port of 127.0.0.1 in the test's own loop, for the HTTP tests:
starting and stopping one, an httpx client of it, and a slower engine under it."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from serving_kit import ENGINE, VOCAB, hicache_config, tiny_model

from hicache.models.config import ModelPreset
from hicache.server.app import HttpServer, Listen
from hicache.server.auth import Access
from hicache.server.limits import Limits
from hicache.server.request_body import ServedModel
from hicache.serving.engine import CacheMode, EngineConfig
from hicache.serving.setup import open_engine

DENSE = ModelPreset.DENSE
GREEDY = {"temperature": 0}
ADMIN_KEY = "admin-key-for-tests"


async def start(
    l3: pathlib.Path | None,
    device_tokens: int = 128,
    mode: CacheMode | None = None,
    engine: EngineConfig = ENGINE,
    tokenizer: Any = None,
    access: Access | None = None,
    limits: Limits | None = None,
) -> HttpServer:
    if mode is None:
        mode = CacheMode.DEVICE_HOST if l3 is None else CacheMode.DEVICE_HOST_L3
    setup = await open_engine(tiny_model(DENSE), mode, hicache_config(l3), device_tokens, engine)
    model = ServedModel("tiny", VOCAB, tokenizer)
    access = access or Access(admin_key=ADMIN_KEY)  # no tenant keys: /v1 is open
    server = HttpServer(setup, model, Listen("127.0.0.1", 0, drain_s=10.0), access, limits)
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.url is not None or task.done():
            break
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raises what stopped it
    server.task = task  # type: ignore[attr-defined]
    return server


async def stop(server: HttpServer) -> None:
    server.stop()
    await asyncio.wait_for(server.task, 30)  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def serving(l3: pathlib.Path | None, **options: Any) -> AsyncIterator[HttpServer]:
    """:func:`start` (with its ``options``) for the ``async with`` block, :func:`stop` after."""
    server = await start(l3, **options)
    try:
        yield server
    finally:
        await stop(server)


def client(server: HttpServer, key: str = ADMIN_KEY) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.AsyncClient(base_url=server.url or "", timeout=30.0, headers=headers)


def slowed(server: HttpServer, seconds: float = 0.01) -> None:
    """Each forward step takes ``seconds`` more: a long answer lasts long enough for its client
    to hang up while it is computed, however fast the machine."""
    model = server.setup.engine.model
    forward = model.forward_batch

    def slow_forward(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)  # in the engine's forward thread, as a slow device would
        return forward(*args, **kwargs)

    model.forward_batch = slow_forward  # type: ignore[method-assign]
