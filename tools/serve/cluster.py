"""``hicache serve --http HOST:PORT --workers N``: N engine processes behind a router process.

The router reads only the model's config and tokenizer (to route by prompt tokens); each worker
loads the model and serves ``serve --http`` on a free port of 127.0.0.1 with the same flags, so
all of them share the L3 the flags name (by default the ``disk://`` store in ``--cache-dir``) in the
model's own namespace: a prefix one worker computed is an L3 hit on another. The L3 URL reaches
the workers in their environment, not on their command lines. A worker that fails to start
stops the others and ``serve`` exits with its error. Once serving, a worker that exits is
started again and one that stops answering is set aside until it answers
(:mod:`~hicache.server.worker_health`). The router serves HTTPS with ``--ssl-certfile`` and
takes the single server's connection and request limits. SIGINT or SIGTERM: the router refuses
new requests, lets those in flight finish, then stops the workers, which drain their own queues.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import secrets
import signal
import ssl
import sys
import tempfile
from collections.abc import Sequence
from urllib.parse import urlsplit

import torch

from hicache.models.config import ModelConfig
from hicache.models.hf.loader import CheckpointPlan
from hicache.scheduling.router import RouterConfig
from hicache.server.request_body import ServedModel
from hicache.server.router import RouterApi, RouterGate, RouterKind
from hicache.server.router_server import RouterServer
from hicache.server.workers import RemoteWorker, Worker, WorkerStartError, start_workers
from hicache.tools.cli_parsing import CommandFailed
from hicache.tools.serve.access import access_of, is_loopback, limits_of
from hicache.tools.serve.http import Background, model_identity, running, served_model

__all__ = ["run_cluster"]


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
    # The router tokenizes prompts to route them, and refuses over-long ones as a worker would.
    served = served_model(name, model, plan, args.device_tokens)
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
    args: argparse.Namespace, argv: Sequence[str], gpus: int, scratch: str
) -> tuple[list[Worker], str]:
    """The workers to route over, and the internal token they take: those at ``--worker``
    URLs (started elsewhere with ``--internal-token-file``), or ``--workers`` processes
    started here with a new token, in a file under ``scratch`` (kept while the router runs:
    a worker started again reads it)."""
    if args.worker:
        token = pathlib.Path(args.internal_token_file).read_text().strip()
        return [RemoteWorker(i, url.rstrip("/")) for i, url in enumerate(args.worker)], token
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
    with tempfile.TemporaryDirectory(prefix="hicache-router-") as scratch:
        await _serve_workers(args, argv, served, router, gpus, scratch)


async def _serve_workers(
    args: argparse.Namespace,
    argv: Sequence[str],
    served: ServedModel,
    router: RouterConfig,
    gpus: int,
    scratch: str,
) -> None:
    workers, token = await _workers(args, argv, gpus, scratch)
    gate = RouterGate(access_of(args, router=True), limits_of(args), token, _worker_tls(args))
    api = RouterApi(workers, RouterKind(args.router), served, router, gate)
    server = RouterServer(api, args.http)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    loop.add_signal_handler(signal.SIGHUP, gate.access.keys.reload)
    for worker in workers:  # the operator's record of where each worker is
        pid = f" (pid {worker.pid})" if worker.pid is not None else ""
        _say(f"worker {worker.index} at {worker.url}{pid}")

    def ready(url: str) -> None:
        print(f"routing {served.name} over {len(workers)} workers ({api.kind.value}) on {url}",
              flush=True)  # fmt: skip

    try:
        await server.serve(ready)
    finally:
        codes = await asyncio.gather(*(w.stop() for w in workers))
        _say(f"workers stopped (exit status {', '.join(map(str, codes))})")


def _worker_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The context checking ``--worker https://`` certificates (``--worker-ca-file``'s CAs, or
    the system's); None without https workers. A cleartext worker off this host is warned
    about: the internal token and prompts would cross the network readable."""
    for url in args.worker:
        host = urlsplit(url).hostname or ""
        if url.startswith("http://") and not is_loopback(host):
            _say(f"warning: worker {url} is not on this host and is reached without TLS")
    if not any(url.startswith("https://") for url in args.worker):
        return None
    context = ssl.create_default_context(cafile=args.worker_ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
