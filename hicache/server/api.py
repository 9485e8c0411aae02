"""An OpenAI-compatible HTTP endpoint over one engine: ``/v1/completions``,
``/v1/chat/completions`` (:mod:`~hicache.server.chat`), ``/v1/models``, ``/health`` and
``/metrics``, on aiohttp.

The server and the engine share one event loop: a handler checks the request
(:mod:`~hicache.server.request_body`), asks the engine whether it can serve it at all (prompt
and output within the context), and submits it to the :class:`~hicache.serving.online.
OnlineSource` the engine's loop reads. It answers when the engine is done with it, or streams
each token as server-sent events. A refused request is a 400 and changes nothing; a request the
engine fails (no device memory for it in time) is a 503. During shutdown new requests get a 503
while those in flight finish.

A request reads and fills the cache namespace of its tenant (the API key's, see
:mod:`~hicache.server.auth`) and its ``cache_salt``.

Every answer carries the generated token ids (``choices[0].token_ids``) besides the text, which
is decoded with the model's tokenizer when it has one (empty otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from hicache.server.answers import Shape, TextStream, error_response, event, models_body, usage
from hicache.server.auth import (
    Access,
    cache_namespace,
    current_tenant,
    openai_app,
)
from hicache.server.chat import parse_chat
from hicache.server.limits import CallerLimiter, Limits, caller_of, check_priority
from hicache.server.metrics import ServingMetrics
from hicache.server.request_body import (
    ApiError,
    CompletionArgs,
    ServedModel,
    parse_body,
    parse_completion,
    read_body,
)
from hicache.serving.engine import Engine
from hicache.serving.online import Admission, OnlineSource, RequestOptions, SourceClosedError
from hicache.serving.request import ServeRequest

__all__ = ["CompletionsApi"]

_HANG_UP_POLL_S = 0.05


class CompletionsApi:
    """The routes of one server; :meth:`app` builds the aiohttp application."""

    def __init__(
        self,
        engine: Engine,
        source: OnlineSource,
        model: ServedModel,
        metrics: ServingMetrics,
        access: Access | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.engine = engine
        self.source = source
        self.model = model
        self.metrics = metrics
        self.access = access or Access()
        self.limits = limits or Limits()
        self.limiter = CallerLimiter(self.limits)
        self.started = int(time.time())

    def app(self) -> web.Application:
        return openai_app(
            self.access,
            self.limits.max_body_bytes,
            completions=self.completions,
            chat=self.chat,
            models=self.models,
            health=self.health,
            metrics=self.metrics_text,
        )

    # ----- routes ---------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        status = 503 if self.source.closed else 200
        body = {"status": "draining" if self.source.closed else "ok", "model": self.model.name,
                "in_flight": self.source.in_flight}  # fmt: skip
        return web.json_response(body, status=status)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(models_body(self.model.name, self.started))

    async def metrics_text(self, _: web.Request) -> web.Response:
        self.metrics.in_flight.set(self.source.in_flight)
        text, content_type = self.metrics.render()
        response = web.Response(body=text)
        response.headers["Content-Type"] = content_type
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parse = functools.partial(parse_completion, model=self.model)
        return await self._limited(request, parse, Shape(False, self.model.name))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        parse = functools.partial(parse_chat, model=self.model)
        return await self._limited(request, parse, Shape(True, self.model.name))

    async def _limited(
        self, request: web.Request, parse: Callable[[Any], CompletionArgs], shape: Shape
    ) -> web.StreamResponse:
        caller = caller_of(request)
        try:
            self._check_room(caller)
        except ApiError as exc:
            self.metrics.refused()
            return error_response(exc)
        try:
            return await self._answer(request, parse, shape)
        finally:
            self.limiter.release(caller)

    async def _answer(
        self, request: web.Request, parse: Callable[[Any], CompletionArgs], shape: Shape
    ) -> web.StreamResponse:
        try:
            args = await self._json(request, parse)
            if args.max_tokens > self.limits.max_tokens:
                raise ApiError(f"max_tokens is at most {self.limits.max_tokens} here",
                               "max_tokens")  # fmt: skip
            check_priority(args.priority, self.access, current_tenant())
            namespace = cache_namespace(current_tenant(), args.cache_salt, self.access.share_cache)
            admission = self._submit(args, namespace)
        except ApiError as exc:
            self.metrics.refused()
            return error_response(exc)
        text = TextStream(self.model.tokenizer, args.stop)
        if args.stream:
            return await self._stream(request, admission, text, (shape, args.include_usage))
        shown = ""
        while (token := await _next_token(request, admission, self.source)) is not None:
            shown += text.push(token)
            if text.stopped:
                break
        served = await self._ended(admission, text)
        if served.record.error is not None:
            error = ApiError(served.record.error, None, status=503)
            return web.json_response(error.body(), status=503)
        shown += text.flush()
        return web.json_response(shape.body(served, shown, text.tokens, _finish(text)))

    # ----- helpers --------------------------------------------------------------------------
    def _check_room(self, caller: str) -> None:
        """Refuse a request the queue or its caller's limits have no room for (nothing is
        taken then); else take its caller's slot."""
        if self.source.in_flight >= self.limits.max_queue:
            raise ApiError("the server is at its queue limit: retry shortly", None, 503,
                           "server_busy", retry_after_s=1.0)  # fmt: skip
        self.limiter.take(caller)

    async def _json(
        self, request: web.Request, parse: Callable[[Any], CompletionArgs]
    ) -> CompletionArgs:
        """The request's body, decoded and checked by ``parse`` (off the loop when large)."""
        return await parse_body(await read_body(request, self.limits.body_timeout_s), parse)

    def _submit(self, args: CompletionArgs, namespace: str | None) -> Admission:
        probe = ServeRequest("probe", args.prompt, args.max_tokens)
        refusal = self.engine.refusal(probe)
        if refusal is not None:
            raise ApiError(refusal, "prompt")
        try:
            tenant = current_tenant()  # tenants take turns at the engine's admission
            options = RequestOptions(args.top_p, args.seed, args.priority, namespace, tenant)
            return self.source.submit(args.prompt, args.max_tokens, args.temperature, options)
        except SourceClosedError as exc:
            raise ApiError(str(exc), None, status=503) from None

    async def _stream(
        self,
        request: web.Request,
        admission: Admission,
        text: TextStream,
        how: tuple[Shape, bool],
    ) -> web.StreamResponse:
        shape, include_usage = how
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})  # fmt: skip
        await response.prepare(request)
        served, timeout = admission.request, self.limits.write_timeout_s
        try:
            while not text.stopped and (token := await admission.tokens.get()) is not None:
                piece = text.push(token)
                chunk = event(shape.chunk(served, piece, [token], None, not text.tokens[1:]))
                await asyncio.wait_for(response.write(chunk), timeout)
        except (ConnectionError, TimeoutError):
            # The client hung up, or stopped reading: stop computing for it, drop it.
            self.source.cancel(admission)
            self.metrics.done(await admission.done)
            if request.transport is not None:
                # abort, not close: close would wait to send what the client is not reading,
                # holding its connection slot for as long as the client likes
                request.transport.abort()
            return response
        served = await self._ended(admission, text)
        if served.record.error is not None:
            tail = [event(ApiError(served.record.error, None, 503).body())]
        else:
            last = shape.chunk(served, text.flush(), [], _finish(text), not text.tokens)
            if not shape.chat:
                last["usage"] = usage(served, len(text.tokens))
            tail = [event(last)]
            if include_usage:
                tail.append(event(shape.usage_chunk(served, len(text.tokens))))
        try:
            for chunk in [*tail, b"data: [DONE]\n\n"]:
                await asyncio.wait_for(response.write(chunk), timeout)
            await response.write_eof()
        except (ConnectionError, TimeoutError):  # gone at the very end: the request is done
            if request.transport is not None:
                request.transport.abort()
        return response

    async def _ended(self, admission: Admission, text: TextStream) -> ServeRequest:
        """Wait for the engine to be done with ``admission`` (ended early at a stop string);
        counted in the metrics."""
        if text.stopped:
            self.source.cancel(admission)  # its text is complete: generate no more
        served = await admission.done
        if text.stopped:
            served.record.error = None  # ended by its stop string, not by a failure
        self.metrics.done(served)
        return served


async def _next_token(
    request: web.Request, admission: Admission, source: OnlineSource
) -> int | None:
    """The next token of ``admission`` (None once it ended, or once its client's connection
    closed: looked at every 50 ms, as aiohttp does not cancel a handler when its client leaves;
    the request is cancelled then)."""
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            source.cancel(admission)  # nobody reads the answer: stop computing it
            return None
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(admission.tokens.get(), _HANG_UP_POLL_S)


def _finish(text: TextStream) -> str:
    return "stop" if text.stopped else "length"
