"""``hicache serve --http``'s access flags: API keys and tenants, the admin key, sharing.

Without any key the server answers everyone, so it may listen only on a loopback address
unless ``--insecure-no-auth`` says that is meant.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import pathlib

from hicache.errors import InvalidArgumentError
from hicache.server.auth import DEFAULT_TENANT, MIN_KEY_CHARS, Access, KeyRing
from hicache.tools.cli_parsing import input_file

__all__ = ["access_of", "add_access_flags"]

_KEY_ENV = "HICACHE_API_KEY"


def add_access_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("access (--http)")
    g.add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help=f"a key of the tenant '{DEFAULT_TENANT}' (repeatable; also ${_KEY_ENV}): every "
        "/v1 request then needs 'Authorization: Bearer KEY'",
    )  # fmt: skip
    g.add_argument(
        "--api-keys", type=input_file, metavar="FILE",
        help="'KEY TENANT' per line ('#' comments), reread on SIGHUP",
    )  # fmt: skip
    g.add_argument(
        "--admin-api-key", metavar="KEY",
        help="turn the /admin routes on, for this key only (off without it)",
    )  # fmt: skip
    g.add_argument(
        "--l3-allow", action="append", default=[], metavar="PREFIX",
        help="a URL prefix /admin/l3/attach accepts (repeatable; e.g. file:///var/cache/); "
        "without one, every attach is refused",
    )  # fmt: skip
    g.add_argument(
        "--share-cache", action="store_true",
        help="tenants share cached prefixes (by default each tenant has a cache of its own)",
    )  # fmt: skip
    g.add_argument("--metrics-public", action="store_true", help="/metrics answers without a key")
    g.add_argument(
        "--insecure-no-auth", action="store_true",
        help="listen on a non-loopback address with no API key (anyone may use the server)",
    )  # fmt: skip


def access_of(args: argparse.Namespace) -> Access:
    """The access rules the flags give; InvalidArgumentError (exit 2) for unsafe or bad ones."""
    direct = [*args.api_key, *([os.environ[_KEY_ENV]] if os.environ.get(_KEY_ENV) else [])]
    for key in [*direct, *([args.admin_api_key] if args.admin_api_key else [])]:
        _check_key(key)
    key_file = pathlib.Path(args.api_keys) if args.api_keys else None
    keys = KeyRing(dict.fromkeys(direct, DEFAULT_TENANT), key_file)
    if args.admin_api_key is not None and keys.tenant_of(args.admin_api_key) is not None:
        raise InvalidArgumentError("--admin-api-key must differ from every tenant key")
    host = args.http.host if args.http is not None else "127.0.0.1"
    if not keys.configured and not _loopback(host) and not args.insecure_no_auth:
        raise InvalidArgumentError(
            f"--http {host} is reachable from other hosts and no API key is set: give "
            "--api-key or --api-keys, or --insecure-no-auth to serve anyone"
        )
    if args.workers > 1 and (keys.configured or args.admin_api_key):
        raise InvalidArgumentError("API keys are enforced by a single server: drop --workers")
    allow = tuple(args.l3_allow)
    return Access(keys, args.admin_api_key, args.share_cache, args.metrics_public, allow)


def _check_key(key: str) -> None:
    if len(key) < MIN_KEY_CHARS or not key.isprintable() or any(c.isspace() for c in key):
        raise InvalidArgumentError(
            f"an API key needs at least {MIN_KEY_CHARS} printable characters and no spaces"
        )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere
