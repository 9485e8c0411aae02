"""Who may use the HTTP server, and whose cache a request reads.

- API keys map to tenants: ``--api-key KEY`` (repeatable, or ``HICACHE_API_KEY``) gives the
  tenant ``default``; ``--api-keys FILE`` holds ``KEY TENANT`` lines (``#`` comments), reread on
  SIGHUP. With any key configured, every ``/v1/*`` request needs ``Authorization: Bearer KEY``.
- A presented key is compared with every configured key in constant time, so the time of a
  refusal says nothing about how much of a key was right. Keys are never logged or echoed: a
  log line names the tenant or a short key id (a hash prefix).
- The admin routes exist only with ``--admin-api-key``, and only that key opens them; a tenant
  key there is a 403.
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
import os
import pathlib
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from hicache.errors import ConfigError

__all__ = [
    "DEFAULT_TENANT",
    "MIN_KEY_CHARS",
    "TENANT_HEADER",
    "Access",
    "KeyRing",
    "access_middleware",
    "openai_errors",
    "cache_namespace",
    "current_tenant",
    "key_id",
    "key_of",
    "parse_key_file",
    "warn_if_others_can_read",
]

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # the tenant of keys given without one (--api-key)
MIN_KEY_CHARS = 8
TENANT_HEADER = "X-Hicache-Tenant"  # from a router to its workers, with the internal token
# The request's tenant, set by the middleware around its handler (the handler's own task).
_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant", default=None)
_MAX_KEY_FILE_BYTES = 1 << 20
_MAX_TENANT_CHARS = 128


def _raw(key: str) -> bytes:
    """A presented key's bytes: aiohttp hands a header's bytes that are not UTF-8 on as
    surrogates, which this turns back into those bytes (a plain encode would raise)."""
    return key.encode("utf-8", "surrogateescape")


def key_id(key: str) -> str:
    """A short, stable name for a key in logs: a hash prefix, never the key."""
    return hashlib.sha256(_raw(key)).hexdigest()[:8]


def parse_key_file(text: str, source: str) -> dict[str, str]:
    """``KEY TENANT`` per line (blank lines and ``#`` comments skipped) as key -> tenant.

    Raises :class:`ConfigError` naming the line (never its key) for a line without exactly
    two fields, a repeated key or an overlong tenant name.
    """
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ConfigError(f"{source}:{number}: want 'KEY TENANT', got {len(fields)} fields")
        key, tenant = fields
        if len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"{source}:{number}: a key has at least {MIN_KEY_CHARS} characters")
        if key in keys:
            raise ConfigError(f"{source}:{number}: this key is listed twice")
        if len(tenant) > _MAX_TENANT_CHARS or not tenant.isprintable():
            raise ConfigError(
                f"{source}:{number}: a tenant is 1-{_MAX_TENANT_CHARS} printable characters"
            )
        keys[key] = tenant
    return keys


def warn_if_others_can_read(fd: int, path: pathlib.Path) -> None:
    """Log a warning for a secret file that its group or other users may read."""
    mode = os.fstat(fd).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "%s is readable by other users (mode %o): keep secrets in a 0600 file",
            path,
            stat.S_IMODE(mode),
        )


class KeyRing:
    """The configured keys: those given directly, and those of a key file (reloadable)."""

    def __init__(self, direct: Mapping[str, str], key_file: pathlib.Path | None = None) -> None:
        self._direct = dict(direct)
        self._file = key_file
        self._keys = dict(direct)
        if key_file is not None:
            self._keys = {**self._direct, **self._read_file()}

    @property
    def configured(self) -> bool:
        return bool(self._keys)

    def reload(self) -> None:
        """Reread the key file (SIGHUP). A file that does not parse, or one that would leave no
        key where there were keys (emptied, or caught half-written by a rotation), keeps the
        keys in force: a server that needed a key never comes to need none."""
        if self._file is None:
            return
        try:
            keys = {**self._direct, **self._read_file()}
        except ConfigError as exc:
            logger.error("API keys not reloaded, the previous ones stay: %s", exc)
            return
        if self._keys and not keys:
            logger.error(
                "API keys not reloaded, the previous ones stay: %s holds no key", self._file
            )
            return
        self._keys = keys
        logger.info("API keys reloaded: %d keys", len(self._keys))

    def tenant_of(self, presented: str) -> str | None:
        """The tenant of ``presented``, or None; every key is compared, in constant time."""
        found: str | None = None
        given = _raw(presented)  # bytes that are not UTF-8 match no configured key
        for key, tenant in self._keys.items():
            if hmac.compare_digest(given, key.encode()):
                found = tenant
        return found

    def _read_file(self) -> dict[str, str]:
        assert self._file is not None
        try:
            with open(self._file, "rb") as f:
                warn_if_others_can_read(f.fileno(), self._file)
                raw = f.read(_MAX_KEY_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(
                f"cannot read the API key file {self._file}: {exc.strerror}"
            ) from None
        if len(raw) > _MAX_KEY_FILE_BYTES:
            raise ConfigError(f"the API key file {self._file} is over {_MAX_KEY_FILE_BYTES} bytes")
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise ConfigError(f"the API key file {self._file} is not UTF-8 text") from None
        return parse_key_file(text, str(self._file))


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


async def _internal(
    request: web.Request, handler: Handler, internal: str, token: str | None
) -> web.StreamResponse:
    if token is None or not hmac.compare_digest(token.encode(), internal.encode()):
        return _refused(request, token)  # nobody reaches a worker around its router
    tenant = request.headers.get(TENANT_HEADER)
    if tenant is not None and not (0 < len(tenant) <= _MAX_TENANT_CHARS and tenant.isprintable()):
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
    return (
        key is not None and token is not None and hmac.compare_digest(token.encode(), key.encode())
    )


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
