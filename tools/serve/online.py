"""``hicache serve --http HOST:PORT [--workers N --router KIND]``: serving clients instead of a
workload; one engine in this process, or N worker processes behind a router.

``--l3 mooncake://auto`` (options after ``?`` kept) starts a ``mooncake_master`` on free ports of
127.0.0.1 for the server's life, points the engines at it, and stops it by pid at exit however
the server ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from hicache.errors import InvalidArgumentError
from hicache.models.tiny import TinyTransformer
from hicache.models.types import ServingModel
from hicache.server.router import RouterKind
from hicache.server.workers import L3_ENV
from hicache.tools.cli_parsing import Flag, add_flags, arg_type, int_range
from hicache.tools.config_flags import l3_url
from hicache.tools.serve.access import (
    access_of,
    add_access_flags,
    add_limit_flags,
    limits_of,
    tls_of,
)
from hicache.tools.serve.cluster import run_cluster
from hicache.tools.serve.config import checked_model, hicache_config, router_config_of
from hicache.tools.serve.http import Background, parse_listen, run_http

__all__ = ["add_online_flags", "run_online"]

_MASTER_CHECK_S = 1.0


def _worker_url(text: str) -> str:
    parts = urlsplit(text)
    scheme_ok = parts.scheme in ("http", "https")
    if not scheme_ok or not parts.hostname or parts.port is None or parts.path.strip("/"):
        raise InvalidArgumentError(f"--worker wants http(s)://HOST:PORT, got {text!r}")
    return text.rstrip("/")


_CLIENT_FLAGS = (
    Flag(
        "--http", arg_type(parse_listen), metavar="HOST:PORT",
        help="serve an OpenAI-compatible /v1/completions (with /health and /metrics) here "
        "until SIGINT or SIGTERM, instead of a workload (port 0: any free port)",
    ),
    Flag(
        "--workers", int_range(1, 256), 1,
        "--http: this many engine processes (one per GPU when CUDA shows several) behind "
        "a router process; they share the L3",
    ),
    Flag(
        "--worker", arg_type(_worker_url), [], metavar="URL", action="append",
        help="--http: route over the worker at URL (repeatable; each started elsewhere with "
        "serve --http ... --internal-token-file FILE) instead of starting --workers; use "
        "https:// (the worker given --ssl-certfile) off this host",
    ),
    Flag.file(
        "--worker-ca-file",
        "--worker https://...: the CA certificates (PEM) the workers' certificates are "
        "checked against (default: the system's)",
    ),
    Flag.choice(
        "--router", RouterKind, RouterKind.CACHE_AWARE,
        "--workers: send each request where its prefix is cached (cache_aware, balanced "
        "by load) or take turns (round_robin)",
    ),
)  # fmt: skip


def add_online_flags(p: argparse.ArgumentParser) -> None:
    add_access_flags(p)
    add_limit_flags(p)
    add_flags(p.add_argument_group("serving clients"), _CLIENT_FLAGS)


def run_online(args: argparse.Namespace) -> int:
    """Serve clients until a signal; refuses the flags that describe a workload."""
    if args.http is None:
        raise InvalidArgumentError("--workers serves clients: give --http HOST:PORT too")
    offline = [flag for flag, on in (("--compare", args.compare), ("--trace", args.trace),
               ("--plot", args.plot), ("--dump-outputs", args.dump_outputs)) if on]  # fmt: skip
    if offline:
        raise InvalidArgumentError(f"--http serves clients; {', '.join(offline)} runs a workload")
    if args.l3 is None and os.environ.get(L3_ENV):  # credentials kept off the command line
        args.l3 = l3_url(os.environ[L3_ENV])
    access, limits = access_of(args), limits_of(args)
    tls = tls_of(args)
    if tls is not None:
        tls.context()  # files that do not load are a usage error now, not after the weights
        args.http = dataclasses.replace(args.http, tls=tls)
    with _auto_mooncake(args) as background:
        hicache = hicache_config(args)  # the model's own namespace: kept across restarts
        config, plan, device = checked_model(args, hicache)
        if args.workers > 1 or args.worker:  # the router loads no weights
            router = router_config_of(args, hicache)
            return run_cluster(args, args.argv, config, plan, device, router, background)
        model: ServingModel = plan.load() if plan else TinyTransformer(config, device)
        return run_http(args, hicache, model, plan, background, (access, limits))


@contextlib.contextmanager
def _auto_mooncake(args: argparse.Namespace) -> Iterator[list[Background]]:
    """With ``--l3 mooncake://auto``: a master for the block, ``args.l3`` naming it; yields the
    task that restarts it (same ports) should it exit, for the server to run."""
    parts = urlsplit(args.l3 or "")
    if parts.scheme != "mooncake" or parts.netloc != "auto":
        yield []
        return
    from hicache.tools.services.mooncake import MooncakeMaster

    with MooncakeMaster() as master:
        args.l3 = master.url(**dict(parse_qsl(parts.query)))
        _say(f"started mooncake_master at {master.address} (pid {master.process.pid})")
        yield [lambda: _keep_alive(master)]


async def _keep_alive(master: Any) -> None:
    """Restart the master when it exits: the engines serve without L3 meanwhile (counted) and
    reconnect to the new one, which starts empty."""
    while True:
        await asyncio.sleep(_MASTER_CHECK_S)
        if master.running:
            continue
        _say("mooncake_master exited; restarting it on the same ports")
        try:
            await asyncio.to_thread(master.restart)
        except Exception as exc:
            _say(f"restarting mooncake_master failed ({exc}); trying again")
        else:
            _say(f"mooncake_master is back (pid {master.process.pid})")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
