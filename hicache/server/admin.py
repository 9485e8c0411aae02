"""Admin endpoints of the HTTP server, for operators: routed only with ``--admin-api-key``,
whose key alone opens them (:mod:`~hicache.server.auth`).

- ``POST /admin/pin`` ``{"prompt", "ttl_s"}``: keep the cached prefix of ``prompt`` on the
  device for ``ttl_s`` seconds (it is evicted after nothing else); answers the tokens pinned.
- ``POST /admin/flush``: drop every cached prefix no running request holds, from the device and
  from host memory (L3 keeps its pages); answers the tokens dropped.
- ``POST /admin/l3/detach``: stop using L3 (its queued writes land first, within the server's
  drain time); ``POST /admin/l3/attach`` ``{"url"}``: start using the L3 at ``url``, which must
  lie under an ``--l3-allow`` rule (:func:`~hicache.server.l3_allow.admitting_rule`; else a 403
  naming the rules). A URL under a rule's backend, host and path that the backend's config
  refuses, or an unreachable store, is a 400 and changes nothing. Answers and errors show the
  URL with its credentials redacted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from hicache.errors import BackendError, ConfigError, InvalidArgumentError
from hicache.keys import RadixKey
from hicache.server.l3_allow import L3NotAllowedError, admitting_rule
from hicache.server.request_body import ApiError, ServedModel, parse_json, prompt_ids
from hicache.serving.engine import Engine
from hicache.urls import redact_url, scrub

__all__ = ["AdminApi"]

_MAX_TTL_S = 7 * 86400.0
_MAX_URL_CHARS = 4096


class AdminApi:
    """The ``/admin`` routes over one engine's cache."""

    def __init__(
        self, engine: Engine, model: ServedModel, drain_s: float, l3_allow: Sequence[str] = ()
    ) -> None:
        self.engine = engine
        self.model = model
        self.drain_s = drain_s
        self.l3_allow = tuple(l3_allow)  # the rules an attached L3's URL must lie under

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/admin/pin", self.pin)
        app.router.add_post("/admin/flush", self.flush)
        app.router.add_post("/admin/l3/attach", self.attach)
        app.router.add_post("/admin/l3/detach", self.detach)

    async def pin(self, request: web.Request) -> web.Response:
        return await _answer(self._pin, request)

    async def flush(self, request: web.Request) -> web.Response:
        return await _answer(self._flush, request)

    async def attach(self, request: web.Request) -> web.Response:
        return await _answer(self._attach, request)

    async def detach(self, request: web.Request) -> web.Response:
        return await _answer(self._detach, request)

    # ----- the actions ----------------------------------------------------------------------
    async def _pin(self, body: dict[str, Any]) -> dict[str, Any]:
        tree = self.engine.tree
        if tree is None:
            raise ApiError("this server runs without a cache: nothing to pin")
        ids = prompt_ids(body.get("prompt"), self.model)
        ttl = _ttl(body.get("ttl_s"))
        node = tree.pin(RadixKey(ids), ttl)
        pinned = tree.match_prefix(RadixKey(ids)).prefix_len if node is not None else 0
        return {"pinned_tokens": pinned, "ttl_s": ttl}

    async def _flush(self, body: dict[str, Any]) -> dict[str, Any]:
        tree, tiered = self.engine.tree, self.engine.hiradix
        if tree is None:
            return {"dropped_tokens": 0}
        dropped = tree.evict(tree.evictable_size)
        if tiered is not None:
            dropped += tiered.evict_host(1 << 62)
        return {"dropped_tokens": dropped}

    async def _attach(self, body: dict[str, Any]) -> dict[str, Any]:
        cache = self.engine.hiradix
        url = body.get("url")
        if cache is None:
            raise ApiError("L3 needs the host tier, and this server runs without one")
        if not isinstance(url, str) or not url or len(url) > _MAX_URL_CHARS:
            raise ApiError(f"url must be a backend URL of at most {_MAX_URL_CHARS} characters",
                           "url")  # fmt: skip
        try:
            admitting_rule(url, self.l3_allow)
        except L3NotAllowedError as exc:
            rules = ", ".join(redact_url(p) for p in self.l3_allow) or "none given"
            why = scrub(f"L3 {url} is under no --l3-allow rule ({exc}; rules: {rules})", url)
            raise ApiError(why, "url", status=403) from None
        except (BackendError, ConfigError, InvalidArgumentError) as exc:
            raise ApiError(scrub(f"L3 {url} not attached: {exc}", url), "url") from None
        try:
            await cache.attach_l3(url)
        except (BackendError, ConfigError, InvalidArgumentError, OSError) as exc:
            raise ApiError(scrub(f"L3 {url} not attached: {exc}", url), "url") from None
        return {"l3": redact_url(url)}

    async def _detach(self, body: dict[str, Any]) -> dict[str, Any]:
        cache = self.engine.hiradix
        detached = cache is not None and await cache.detach_l3(self.drain_s)
        return {"l3": None, "detached": detached}


def _ttl(value: Any) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not 0 < value <= _MAX_TTL_S:
        raise ApiError(f"ttl_s must be a number in (0, {_MAX_TTL_S:g}], got {value!r}", "ttl_s")
    return float(value)


async def _answer(action: Any, request: web.Request) -> web.Response:
    try:
        raw = await request.read()
        body = parse_json(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        return web.json_response(await action(body))
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status)
