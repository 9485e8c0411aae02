"""Who may use the HTTP server, and whose cache a request reads.

- API keys map to tenants: ``--api-key KEY`` (repeatable, or ``HICACHE_API_KEY``) gives the
  tenant ``default``; ``--api-keys FILE`` holds ``KEY TENANT [max_priority=N]`` lines
  (:mod:`~hicache.server.key_file`), reread on SIGHUP. With any key configured, every ``/v1/*``
  request needs ``Authorization: Bearer KEY``.
- A request may ask for a ``priority`` up to its tenant's cap (:func:`priority_cap`): the key
  file's ``max_priority=N`` for the tenant, else the server's ``--max-priority`` (default 0,
  so a request may lower its priority but raising it takes the operator's word).
- A presented key is compared with every configured key in constant time, so the time of a
  refusal says nothing about how much of a key was right. Keys are never logged or echoed: a
  log line names the tenant or a short key id (a hash prefix).
- The admin routes exist only with an admin key (``--admin-api-key``, ``--admin-api-key-file``
  or ``HICACHE_ADMIN_API_KEY``), and only that key opens them; a tenant key there is a 403.
- A request's cache namespace (device and host trees, L3 keys) is a digest of its tenant and
  its ``cache_salt``: two tenants, or two salts, share no cached page, so neither
  ``cached_tokens`` nor time to first token says what another tenant's prompts begin with.
  ``--share-cache`` drops the tenant from it (the salt still separates).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from hicache.errors import ConfigError
from hicache.server.key_file import (
    MAX_TENANT_CHARS,
    MIN_KEY_CHARS,
    KeyFile,
    parse_key_file,
    read_key_file,
    warn_if_others_can_read,
)
from hicache.server.request_body import MAX_PRIORITY

__all__ = [
    "DEFAULT_TENANT",
    "MIN_KEY_CHARS",
    "TENANT_HEADER",
    "Access",
    "KeyRing",
    "access_middleware",
    "openai_app",
    "openai_errors",
    "cache_namespace",
    "current_tenant",
    "key_id",
    "key_of",
    "parse_key_file",
    "priority_cap",
    "warn_if_others_can_read",
]

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # the tenant of keys given without one (--api-key)
TENANT_HEADER = "X-Hicache-Tenant"  # from a router to its workers, with the internal token
# The request's tenant, set by the middleware around its handler (the handler's own task).
_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant", default=None)


def _raw(key: str) -> bytes:
    """A presented key's bytes: aiohttp hands a header's bytes that are not UTF-8 on as
    surrogates, which this turns back into those bytes (a plain encode would raise)."""
    return key.encode("utf-8", "surrogateescape")


def key_id(key: str) -> str:
    """A short, stable name for a key in logs: a hash prefix, never the key."""
    return hashlib.sha256(_raw(key)).hexdigest()[:8]


class KeyRing:
    """The configured keys: those given directly (the tenant of each given with it), and
    those of a key file with its tenants' priority caps (reloadable)."""

    def __init__(self, direct: Mapping[str, str], key_file: pathlib.Path | None = None) -> None:
        self._direct = dict(direct)
        self._file = key_file
        # One object, swapped whole on a reload: keys and caps always come from one file.
        self._state = KeyFile(self._direct)
        if key_file is not None:
            self._state = self._merged(read_key_file(key_file))

    @property
    def configured(self) -> bool:
        return bool(self._state.keys)

    def reload(self) -> None:
        """Reread the key file (SIGHUP), its keys and priority caps. A file that does not
        parse, or one that would leave no key where there were keys (emptied, or caught
        half-written by a rotation), keeps the keys and caps in force: a server that needed a
        key never comes to need none."""
        if self._file is None:
            return
        try:
            state = self._merged(read_key_file(self._file))
        except ConfigError as exc:
            logger.error("API keys not reloaded, the previous ones stay: %s", exc)
            return
        if self._state.keys and not state.keys:
            logger.error(
                "API keys not reloaded, the previous ones stay: %s holds no key", self._file
            )
            return
        self._state = state
        logger.info("API keys reloaded: %d keys", len(state.keys))

    def tenant_of(self, presented: str) -> str | None:
        """The tenant of ``presented``, or None; every key is compared, in constant time."""
        found: str | None = None
        given = _raw(presented)  # bytes that are not UTF-8 match no configured key
        for key, tenant in self._state.keys.items():
            if hmac.compare_digest(given, key.encode()):
                found = tenant
        return found

    def priority_cap(self, tenant: str) -> int | None:
        """The key file's ``max_priority`` for ``tenant``, or None where it sets none."""
        return self._state.priority_caps.get(tenant)

    def _merged(self, read: KeyFile) -> KeyFile:
        return KeyFile({**self._direct, **read.keys}, read.priority_caps)


@dataclass(frozen=True, slots=True)
class Access:
    """The server's access rules."""

    keys: KeyRing = field(default_factory=lambda: KeyRing({}))
    admin_key: str | None = None
    share_cache: bool = False
    metrics_public: bool = False
    l3_allow: tuple[str, ...] = ()  # URL prefixes /admin/l3/attach accepts
    # A worker behind a router: only the router's token opens it, and the router names the
    # request's tenant (``X-Hicache-Tenant``); tenant keys are the router's to check.
    internal_token: str | None = None
    # The highest priority a request may ask for where the key file sets no cap for its tenant.
    max_priority: int = 0

    def __post_init__(self) -> None:
        cap = self.max_priority
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= MAX_PRIORITY:
            raise ConfigError(f"max_priority must be an integer in [0, {MAX_PRIORITY}], "
                              f"got {cap!r}")  # fmt: skip


def priority_cap(access: Access, tenant: str | None) -> int:
    """The highest ``priority`` a request of ``tenant`` may ask for under ``access``: the key
    file's ``max_priority`` for the tenant, else ``access.max_priority``. A worker behind a
    router (``access.internal_token``) takes any priority: its router applied the cap."""
    if access.internal_token is not None:
        return MAX_PRIORITY
    own = access.keys.priority_cap(tenant) if tenant is not None else None
    return access.max_priority if own is None else own


def cache_namespace(tenant: str | None, salt: str | None, share_cache: bool) -> str | None:
    """The cache namespace of a request: None (the shared one) without a tenant or a salt,
    else a digest of both, so that names never appear in keys or trees."""
    owner = None if share_cache else tenant
    if owner is None and salt is None:
        return None
    digest = hashlib.sha256(f"{owner or ''}\0{salt or ''}".encode()).hexdigest()[:32]
    return f"ns-{digest}"


def _error(status: int, message: str, kind: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


def key_of(request: web.Request) -> str | None:
    """The key a request presents (``Authorization: Bearer KEY``), if any."""
    return _bearer(request)


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals (an unknown route, a method a route lacks) in OpenAI's error
    shape, as every other error is."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        code = "not_found" if exc.status == 404 else exc.reason.lower().replace(" ", "_")
        return _error(exc.status, f"{request.method} {request.path}: {exc.reason}", kind, code)


def access_middleware(access: Access) -> Middleware:
    """An aiohttp middleware enforcing ``access``; the handler of a request let through finds
    its tenant with :func:`current_tenant`."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        token = _bearer(request)
        if path == "/health":
            return await handler(request)
        if access.internal_token is not None:
            return await _internal(request, handler, access.internal_token, token)
        if path.startswith("/admin/"):
            return await _admin(request, handler, access, token)
        tenant = access.keys.tenant_of(token) if token is not None else None
        needs_key = access.keys.configured and not (path == "/metrics" and access.metrics_public)
        if needs_key and tenant is None and not _is_admin(access, token):
            return _refused(request, token)
        token_set = _TENANT.set(tenant)
        try:
            return await handler(request)
        finally:
            _TENANT.reset(token_set)

    return check


def openai_app(
    access: Access,
    max_body_bytes: int,
    *,
    completions: Handler,
    chat: Handler,
    models: Handler,
    health: Handler,
    metrics: Handler,
) -> web.Application:
    """The OpenAI-compatible routes that a server and a router both serve, behind the same
    checks: OpenAI-shaped refusals, ``access``, bodies of at most ``max_body_bytes``."""
    middlewares = [openai_errors, access_middleware(access)]
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def _internal(
    request: web.Request, handler: Handler, internal: str, token: str | None
) -> web.StreamResponse:
    if token is None or not hmac.compare_digest(_raw(token), internal.encode()):
        return _refused(request, token)  # nobody reaches a worker around its router
    tenant = request.headers.get(TENANT_HEADER)
    if tenant is not None and not (0 < len(tenant) <= MAX_TENANT_CHARS and tenant.isprintable()):
        return _error(400, f"a bad {TENANT_HEADER} header", "invalid_request_error", "bad_tenant")
    token_set = _TENANT.set(tenant)
    try:
        return await handler(request)
    finally:
        _TENANT.reset(token_set)


def current_tenant() -> str | None:
    """The tenant of the request being handled (None when no key is configured)."""
    return _TENANT.get()


def _is_admin(access: Access, token: str | None) -> bool:
    key = access.admin_key
    return key is not None and token is not None and hmac.compare_digest(_raw(token), key.encode())


async def _admin(
    request: web.Request, handler: Handler, access: Access, token: str | None
) -> web.StreamResponse:
    if access.admin_key is None:
        raise web.HTTPNotFound()
    if _is_admin(access, token):
        return await handler(request)
    if token is not None and access.keys.tenant_of(token) is not None:
        logger.info("refused %s %s: a tenant key on an admin route", request.method, request.path)
        return _error(403, "admin routes need the admin key", "permission_error", "forbidden")
    return _refused(request, token)


def _refused(request: web.Request, token: str | None) -> web.Response:
    who = f"key id {key_id(token)}" if token is not None else "no key"
    logger.info("refused %s %s: %s", request.method, request.path, who)
    if token is None:
        message = "this server needs an API key: send 'Authorization: Bearer KEY'"
    else:
        message = "the API key is not valid here"
    return _error(401, message, "invalid_request_error", "invalid_api_key")
