"""``hicache serve --http``'s access flags: API keys and tenants, the admin key, sharing,
the priority cap, and the request limits.

Without any key the server answers everyone, so it may listen only on a loopback address
unless ``--insecure-no-auth`` says that is meant. The admin key comes from one of
``--admin-api-key``, ``--admin-api-key-file`` or ``$HICACHE_ADMIN_API_KEY`` (the last two keep
it off the command line, which other users can read in ``/proc``).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import pathlib

from hicache.errors import InvalidArgumentError
from hicache.server.app import TlsFiles
from hicache.server.auth import (
    DEFAULT_TENANT,
    MIN_KEY_CHARS,
    Access,
    KeyRing,
    warn_if_others_can_read,
)
from hicache.server.l3_allow import check_allow_rules
from hicache.server.limits import Limits
from hicache.server.request_body import MAX_PRIORITY
from hicache.tools.cli_parsing import (
    Flag,
    add_flags,
    fields_from,
    float_range,
    input_file,
    int_range,
    size_range,
)

__all__ = [
    "access_of",
    "add_access_flags",
    "add_limit_flags",
    "is_loopback",
    "limits_of",
    "tls_of",
]

_KEY_ENV = "HICACHE_API_KEY"
_ADMIN_ENV = "HICACHE_ADMIN_API_KEY"
_MAX_SECRET_FILE_BYTES = 64 << 10


_ACCESS_FLAGS = (
    Flag(
        "--api-key", default=[], metavar="KEY", action="append",
        help=f"a key of the tenant '{DEFAULT_TENANT}' (repeatable; also ${_KEY_ENV}): every "
        "/v1 request then needs 'Authorization: Bearer KEY'",
    ),
    Flag.file(
        "--api-keys",
        "'KEY TENANT' or 'KEY TENANT max_priority=N' per line ('#' comments), reread on "
        "SIGHUP; max_priority=N is the tenant's cap in place of --max-priority",
    ),
    Flag(
        "--max-priority", int_range(0, MAX_PRIORITY), 0, metavar="N",
        help="the highest 'priority' a request may ask for, where the key file sets no cap for "
        "its tenant; past it a 400 (default 0: a request may only lower its priority)",
    ),
    Flag(
        "--admin-api-key", metavar="KEY",
        help="turn the /admin routes on, for this key only (off without it; visible to other "
        f"users in the process list: prefer --admin-api-key-file or ${_ADMIN_ENV})",
    ),
    Flag.file("--admin-api-key-file", "as --admin-api-key, the key being the first line of FILE"),
    Flag(
        "--l3-allow", default=[], metavar="PREFIX", action="append",
        help="a URL prefix /admin/l3/attach accepts (repeatable; e.g. file:///var/cache/); "
        "without one, every attach is refused",
    ),
    Flag.switch(
        "--share-cache",
        "tenants share cached prefixes (by default each tenant has a cache of its own)",
    ),
    Flag.switch("--metrics-public", "/metrics answers without a key"),
    Flag.file(
        "--internal-token-file",
        "a worker behind a router: take only the token in FILE (the router's)",
    ),
    Flag("--ssl-certfile", input_file, help="serve HTTPS with this PEM chain"),
    Flag("--ssl-keyfile", input_file, help="and this PEM private key"),
    Flag.switch(
        "--insecure-no-auth",
        "listen on a non-loopback address with no API key (anyone may use the server)",
    ),
)  # fmt: skip


def add_access_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p.add_argument_group("access (--http)"), _ACCESS_FLAGS)


_DEFAULT_LIMITS = Limits()
_COUNT = int_range(1, 1 << 20)
_SECONDS = float_range(0.0, 3600.0, low_open=True)
# Each Limits field and the flag that sets it; a flag's default is the field's (add_limit_flags).
_LIMIT_FLAGS = {
    "max_body_bytes": Flag(
        "--max-body-bytes", size_range(1 << 10, 1 << 30),
        help="a larger request body is a 413 (default 16M)",
    ),
    "max_tokens": Flag(
        "--max-tokens-cap", _COUNT,
        help=f"the most max_tokens a request may ask for (default {_DEFAULT_LIMITS.max_tokens})",
    ),
    "max_queue": Flag(
        "--max-queue", _COUNT,
        help="requests in flight past which a new one is a 503 with Retry-After "
        f"(default {_DEFAULT_LIMITS.max_queue})",
    ),
    "rate_per_s": Flag(
        "--rate-limit", float_range(0.0, 1e6, low_open=True), metavar="PER_S",
        help="requests a second per tenant (all its keys together; per client address without "
        "keys); past it a 429 (default: no limit)",
    ),
    "max_concurrent": Flag(
        "--max-concurrent", _COUNT,
        help="requests in flight per tenant (all its keys together; per client address without "
        "keys); past it a 429 (default: no limit, up to --max-queue)",
    ),
    "max_connections": Flag(
        "--max-connections", _COUNT,
        help="open connections; past it a new one is closed "
        f"(default {_DEFAULT_LIMITS.max_connections})",
    ),
    "max_connections_per_client": Flag(
        "--max-connections-per-client", _COUNT, metavar="N",
        help="open connections from one client address; past it a new one from there is closed "
        f"(default {_DEFAULT_LIMITS.max_connections_per_client})",
    ),
    "header_timeout_s": Flag(
        "--header-timeout", _SECONDS, metavar="S",
        help="close a connection whose first request head has not arrived by then (default 10)",
    ),
    "body_timeout_s": Flag(
        "--body-timeout", _SECONDS, metavar="S",
        help="a request body not arrived by then is a 408 (default 30)",
    ),
    "write_timeout_s": Flag(
        "--write-timeout", _SECONDS, metavar="S",
        help="drop a stream whose client has not taken a chunk by then (default 30)",
    ),
}  # fmt: skip


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("request limits (--http)")
    for field, flag in _LIMIT_FLAGS.items():
        dataclasses.replace(flag, default=getattr(_DEFAULT_LIMITS, field)).add_to(g)


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(**fields_from(args, _LIMIT_FLAGS))


def tls_of(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS files the flags name (both, or neither)."""
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise InvalidArgumentError("--ssl-certfile and --ssl-keyfile go together")
    return TlsFiles(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None


def access_of(args: argparse.Namespace, router: bool = False) -> Access:
    """The access rules the flags give; InvalidArgumentError (exit 2) for unsafe or bad ones.
    ``router``: the rules of a router, whose ``--internal-token-file`` is its workers'."""
    direct = [*args.api_key, *([os.environ[_KEY_ENV]] if os.environ.get(_KEY_ENV) else [])]
    for key in direct:
        _check_key(key)
    admin_key = _admin_key(args)
    key_file = pathlib.Path(args.api_keys) if args.api_keys else None
    keys = KeyRing(dict.fromkeys(direct, DEFAULT_TENANT), key_file)
    if admin_key is not None and keys.tenant_of(admin_key) is not None:
        raise InvalidArgumentError("the admin key must differ from every tenant key")
    host = args.http.host if args.http is not None else "127.0.0.1"
    routing = args.workers > 1 or bool(args.worker)
    behind_router = bool(args.internal_token_file) and not router and not routing
    # A worker behind a router takes the router's token alone: that is its key.
    keyless = not keys.configured and not behind_router
    if keyless and not is_loopback(host) and not args.insecure_no_auth:
        raise InvalidArgumentError(
            f"--http {host} is reachable from other hosts and no API key is set: give "
            "--api-key or --api-keys, or --insecure-no-auth to serve anyone"
        )
    if routing and admin_key is not None:
        raise InvalidArgumentError("the admin routes are a single server's: drop --workers")
    if args.worker and not args.internal_token_file:
        raise InvalidArgumentError("--worker needs --internal-token-file: the workers' token")
    if behind_router:
        with open(args.internal_token_file, encoding="utf-8") as f:
            warn_if_others_can_read(f.fileno(), pathlib.Path(args.internal_token_file))
            token = f.read().strip()
        if len(token) < 16:
            raise InvalidArgumentError("the internal token file holds fewer than 16 characters")
        return Access(share_cache=args.share_cache, internal_token=token)
    allow = tuple(args.l3_allow)
    check_allow_rules(allow)
    return Access(keys, admin_key, args.share_cache, args.metrics_public, allow,
                  max_priority=args.max_priority)  # fmt: skip


def _admin_key(args: argparse.Namespace) -> str | None:
    """The admin key from whichever one of its three sources is given, checked as a key."""
    given = {
        "--admin-api-key": args.admin_api_key,
        "--admin-api-key-file": args.admin_api_key_file,
        f"${_ADMIN_ENV}": os.environ.get(_ADMIN_ENV) or None,  # set but empty: not given
    }
    named = [name for name, value in given.items() if value is not None]
    if len(named) > 1:
        raise InvalidArgumentError(
            f"the admin key is given {len(named)} ways ({', '.join(named)}): give one of "
            f"--admin-api-key, --admin-api-key-file and ${_ADMIN_ENV}"
        )
    if not named:
        return None
    if args.admin_api_key_file is not None:
        key = _first_line(pathlib.Path(args.admin_api_key_file))
    elif args.admin_api_key is not None:
        key = args.admin_api_key
    else:
        key = os.environ[_ADMIN_ENV]
    _check_key(key)
    return key


def _first_line(path: pathlib.Path) -> str:
    """The first line of a secret file, stripped (warned about if others may read it)."""
    try:
        with open(path, "rb") as f:
            warn_if_others_can_read(f.fileno(), path)
            raw = f.readline(_MAX_SECRET_FILE_BYTES)
        return raw.decode().strip()
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{path} is not UTF-8 text") from None


def _check_key(key: str) -> None:
    if len(key) < MIN_KEY_CHARS or not key.isprintable() or any(c.isspace() for c in key):
        raise InvalidArgumentError(
            f"an API key needs at least {MIN_KEY_CHARS} printable characters and no spaces"
        )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost`` (another name may resolve
    anywhere, so it is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere
