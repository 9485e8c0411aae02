"""``hicache serve --http HOST:PORT --workers N``: N engine processes behind a router process.

The router reads only the model's config and tokenizer (to route by prompt tokens); each worker
loads the model and serves ``serve --http`` on a free port of 127.0.0.1 with the same flags, so
all of them share the L3 the flags name (by default the file store in ``--cache-dir``) in the
model's own namespace: a prefix one worker computed is an L3 hit on another. A worker that
fails to start stops the others and ``serve`` exits with its error. A worker that dies is
retired by the router. SIGINT or SIGTERM: the router refuses new requests, lets those in flight
finish, then stops the workers, which drain their own queues.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import secrets
import signal
import sys
import tempfile
from collections.abc import Sequence

import aiohttp
import torch
from aiohttp import web

from hicache.models.config import ModelConfig
from hicache.models.hf.loader import CheckpointPlan
from hicache.scheduling.router import RouterConfig
from hicache.server.request_body import ServedModel
from hicache.server.router import RouterApi, RouterGate, RouterKind
from hicache.server.workers import RemoteWorker, Worker, WorkerStartError, start_workers
from hicache.tools.cli_parsing import CommandFailed
from hicache.tools.serve.access import access_of, limits_of
from hicache.tools.serve.http import Background, model_identity, running, served_model

__all__ = ["run_cluster"]

_WATCH_S = 0.5  # how often the router looks for workers that exited or stopped answering
_HEALTH_TIMEOUT_S = 1.0


def run_cluster(
    args: argparse.Namespace,
    argv: Sequence[str],
    model: ModelConfig,
    plan: CheckpointPlan | None,
    device: torch.device,
    router: RouterConfig,
    background: Sequence[Background] = (),
) -> int:
    """Route over ``args.workers`` workers until a signal, by ``router``'s model of them; 0
    after a clean stop."""
    name, _ = model_identity(model, plan)
    served = served_model(name, model, plan)  # the router tokenizes prompts to route them
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    try:
        asyncio.run(_route(args, argv, served, router, gpus, background))
    except WorkerStartError as exc:
        raise CommandFailed(str(exc)) from None
    return 0


async def _route(
    args: argparse.Namespace,
    argv: Sequence[str],
    served: ServedModel,
    router: RouterConfig,
    gpus: int,
    background: Sequence[Background],
) -> None:
    async with running(background):  # the L3 master stays up while workers start and serve
        await _route_requests(args, argv, served, router, gpus)


async def _workers(
    args: argparse.Namespace, argv: Sequence[str], gpus: int
) -> tuple[list[Worker], str]:
    """The workers to route over, and the internal token they take: those at ``--worker``
    URLs (started elsewhere with ``--internal-token-file``), or ``--workers`` processes
    started here with a new token."""
    if args.worker:
        token = pathlib.Path(args.internal_token_file).read_text().strip()
        return [RemoteWorker(i, url.rstrip("/")) for i, url in enumerate(args.worker)], token
    with tempfile.TemporaryDirectory(prefix="hicache-router-") as scratch:
        # The workers' only key, in a file only this user can read (never on a command line).
        token, token_file = secrets.token_urlsafe(32), os.path.join(scratch, "internal-token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token)
        started = await start_workers(argv, args.workers, gpus, l3=args.l3, token_file=token_file)
    return list(started), token


async def _route_requests(
    args: argparse.Namespace,
    argv: Sequence[str],
    served: ServedModel,
    router: RouterConfig,
    gpus: int,
) -> None:
    workers, token = await _workers(args, argv, gpus)
    gate = RouterGate(access_of(args, router=True), limits_of(args), token)
    api = RouterApi(workers, RouterKind(args.router), served, router, gate)
    runner = web.AppRunner(api.app(), handle_signals=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, gate.access.keys.reload)
    watcher = asyncio.create_task(_watch(api, workers, stop))
    try:
        await runner.setup()
        site = web.TCPSite(runner, args.http.host, args.http.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"routing {served.name} over {len(workers)} workers ({api.kind.value}) on "
              f"http://{host}:{port}", flush=True)  # fmt: skip
        await stop.wait()
        api.closing = True
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await runner.cleanup()  # the requests in flight are answered first
        codes = await asyncio.gather(*(w.stop() for w in workers))
        print(f"workers stopped (exit status {', '.join(map(str, codes))})", file=sys.stderr,
              flush=True)  # fmt: skip


async def _watch(api: RouterApi, workers: list[Worker], stop: asyncio.Event) -> None:
    """Retire workers whose process exited or that stopped answering ``/health``; stop the
    router once none is left."""
    while True:
        for worker in workers:
            if isinstance(worker, RemoteWorker) and worker.index in api.tree.alive:
                worker.answering = await _answers(api, worker)
            if not worker.alive and worker.index in api.tree.alive:
                print(f"worker {worker.index} {worker.ended()}; no more requests go to it",
                      file=sys.stderr, flush=True)  # fmt: skip
                api.tree.retire(worker.index)
        if not api.tree.alive:
            print("every worker has exited: stopping", file=sys.stderr, flush=True)
            stop.set()
            return
        await asyncio.sleep(_WATCH_S)


async def _answers(api: RouterApi, worker: RemoteWorker) -> bool:
    """Whether ``worker``'s ``/health`` answers 200 within a second."""
    try:
        timeout = aiohttp.ClientTimeout(total=_HEALTH_TIMEOUT_S)
        async with api.session.get(f"{worker.url}/health", timeout=timeout) as answer:
            return answer.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
