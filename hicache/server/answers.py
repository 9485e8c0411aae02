"""What the endpoints answer: OpenAI's completion and chat bodies and stream chunks, and the text
of the tokens as they come, cut before a stop string.

Every choice carries the generated token ids (``token_ids``) besides the text. A stream never
shows text that a stop string could still claim: the last ``len(longest stop) - 1`` characters
wait for the next token, and so does a trailing U+FFFD (a character whose bytes are not all
there yet).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hicache.server.request_body import ApiError
from hicache.serving.request import ServeRequest

__all__ = ["Shape", "TextStream", "error_response", "event", "models_body", "usage"]

_PARTIAL = "\ufffd"


class TextStream:
    """The text of a request's tokens, ended before the first of ``stops`` it holds."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # shown so far
        self.stopped = False

    def push(self, token: int) -> str:
        """Add ``token``; the text that may be shown now."""
        self.tokens.append(token)
        if self._tokenizer is None:
            return ""
        text = self._tokenizer.decode(self.tokens)
        cuts = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if cuts:
            self.stopped = True
            return self._show(text, max(min(cuts), len(self.text)))
        safe = len(text) - self._hold
        while safe > len(self.text) and text[safe - 1] == _PARTIAL:
            safe -= 1
        return self._show(text, safe)

    def flush(self) -> str:
        """The rest of the text, once no token follows."""
        if self._tokenizer is None or self.stopped or not self.tokens:
            return ""
        return self._show(self._tokenizer.decode(self.tokens), None)

    def _show(self, text: str, end: int | None) -> str:
        new = text[len(self.text) : end]
        self.text += new
        return new


@dataclass(frozen=True, slots=True)
class Shape:
    """The bodies of one endpoint: ``chat`` or plain completions, for ``model``."""

    chat: bool
    model: str

    def body(
        self, request: ServeRequest, text: str, tokens: list[int], finish: str
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "token_ids": tokens, "logprobs": None,
                                  "finish_reason": finish}  # fmt: skip
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out = self._head(request, "chat.completion" if self.chat else "text_completion")
        return {**out, "choices": [choice], "usage": usage(request, len(tokens))}

    def chunk(
        self, request: ServeRequest, text: str, tokens: list[int], finish: str | None, first: bool
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "token_ids": tokens, "logprobs": None,
                                  "finish_reason": finish}  # fmt: skip
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            choice["delta"] = {**delta, "content": text} if text or first else delta
        else:
            choice["text"] = text
        out = self._head(request, "chat.completion.chunk" if self.chat else "text_completion")
        return {**out, "choices": [choice]}

    def usage_chunk(self, request: ServeRequest, generated: int) -> dict[str, Any]:
        """The last chunk of a stream asked for with ``stream_options.include_usage``."""
        out = self._head(request, "chat.completion.chunk" if self.chat else "text_completion")
        return {**out, "choices": [], "usage": usage(request, generated)}

    def _head(self, request: ServeRequest, kind: str) -> dict[str, Any]:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{request.rid}", "object": kind, "created": int(time.time()),
                "model": self.model}  # fmt: skip


def usage(request: ServeRequest, generated: int) -> dict[str, Any]:
    """OpenAI's usage, with the cached prompt tokens per tier (device, host, l3) as well."""
    prompt, record = len(request.prompt), request.record
    tiers = {"device": record.hit_device, "host": record.hit_host, "l3": record.hit_l3}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": sum(tiers.values()), **tiers},
    }


def models_body(name: str, created: int) -> dict[str, Any]:
    """``/v1/models``: the one model served."""
    model = {"id": name, "object": "model", "created": created, "owned_by": "hicache"}
    return {"object": "list", "data": [model]}


def error_response(exc: ApiError) -> web.Response:
    """A refusal in OpenAI's error shape, with ``Retry-After`` when it says when to retry."""
    response = web.json_response(exc.body(), status=exc.status)
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return response


def event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
