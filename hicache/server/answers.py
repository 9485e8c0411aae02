"""What the endpoints answer: OpenAI's completion and chat bodies and stream chunks, and the text
of the tokens as they come, cut before a stop string.

Every choice carries the generated token ids (``token_ids``) besides the text. A stream never
shows text that a stop string could still claim: the last ``len(longest stop) - 1`` characters
wait for the next token, and so does a trailing U+FFFD (a character whose bytes are not all
there yet).

The text is decoded a few tokens at a time (:class:`IncrementalText`), not whole at every token,
so a stream's decoding work grows with its length rather than with its square.
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

__all__ = [
    "IncrementalText",
    "Shape",
    "TextStream",
    "error_response",
    "event",
    "models_body",
    "usage",
]

_PARTIAL = "\ufffd"
# A window whose text ends in U+FFFD waits for more tokens (the character's other bytes). A
# character is at most 4 bytes and a token at least one byte, so after _MAX_PENDING such tokens
# the text before the last _UNFINISHED of them is settled where those leave it as it is; after
# _MAX_UNSETTLED (a decoder whose text never settles) the whole window's text is.
_MAX_PENDING = 8
_UNFINISHED = 3
_MAX_UNSETTLED = 4 * _MAX_PENDING


class IncrementalText:
    """The text of a growing token list, a window of its last few tokens decoded per token (as
    vLLM and TGI decode): the tokens settled at the last step, decoded again as context for
    where the new text starts, and those after them. :meth:`push` gives the text that settles;
    the window is at most ``2 * _MAX_UNSETTLED`` tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._prefix = 0  # the window's first token
        self._read = 0  # tokens before it are settled
        self._prefix_text = ""  # the text of tokens[_prefix:_read]

    def push(self, tokens: list[int]) -> tuple[str, str]:
        """(the text ``tokens`` settles now, their text after it that may still change), after
        a token was appended to ``tokens``."""
        window = self._tokenizer.decode(tokens[self._prefix :])
        known = len(self._prefix_text)
        if len(window) >= known and not window.endswith(_PARTIAL):
            return self._settle(tokens, len(tokens), window), ""
        waiting = len(tokens) - self._read
        if waiting >= _MAX_UNSETTLED:
            return self._settle(tokens, len(tokens), window), ""
        if waiting >= _MAX_PENDING:
            settled = self._split(tokens, window)
            if settled is not None:
                return settled, window[known + len(settled) :]
        return "", window[known:]

    def _split(self, tokens: list[int], window: str) -> str | None:
        """Settle all but the last few tokens, at the latest point whose text the tokens after
        it leave as it is; None when none of the last few is such a point. A character that
        straddles the first point tried starts at most _UNFINISHED tokens before it."""
        last = len(tokens) - _UNFINISHED
        for end in range(last, last - _UNFINISHED - 1, -1):
            head = self._tokenizer.decode(tokens[self._prefix : end])
            if len(head) >= len(self._prefix_text) and window.startswith(head):
                return self._settle(tokens, end, head)
        return None

    def _settle(self, tokens: list[int], end: int, text: str) -> str:
        """Settle ``tokens[:end]``, whose window text is ``text``; the text new to it."""
        new = text[len(self._prefix_text) :]
        region = self._tokenizer.decode(tokens[self._read : end])
        # The next window starts with the tokens just settled, unless they have no text (special
        # tokens, dropped before decoding): a decoder that drops the first token's leading space
        # (SentencePiece's) would then drop a later token's, which the whole text keeps.
        if region or end - self._prefix > _MAX_UNSETTLED:
            self._prefix, self._prefix_text = self._read, region
        else:
            self._prefix_text = text
        self._read = end
        return new


class TextStream:
    """The text of a request's tokens, ended before the first of ``stops`` it holds."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self._decoder = None if tokenizer is None else IncrementalText(tokenizer)
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._settled = ""  # the tokens' text that no later token changes
        self._unsettled = ""  # the rest of their text, as it decodes now
        self.tokens: list[int] = []
        self.text = ""  # shown so far
        self.stopped = False

    def push(self, token: int) -> str:
        """Add ``token``; the text that may be shown now."""
        self.tokens.append(token)
        if self._decoder is None:
            return ""
        checked = len(self._settled)  # searched at the last token, and no token changes it
        new, self._unsettled = self._decoder.push(self.tokens)
        self._settled += new
        text = self._settled + self._unsettled if self._unsettled else self._settled
        cuts = [i for s in self._stops if (i := text.find(s, max(0, checked - len(s) + 1))) >= 0]
        if cuts:
            self.stopped = True
            return self._show(text, max(min(cuts), len(self.text)))
        safe = len(text) - self._hold
        if safe > len(self.text):  # not past a trailing U+FFFD: its bytes may still be coming
            safe = len(self.text) + len(text[len(self.text) : safe].rstrip(_PARTIAL))
        return self._show(text, safe)

    def flush(self) -> str:
        """The rest of the text, once no token follows."""
        if self._decoder is None or self.stopped or not self.tokens:
            return ""
        return self._show(self._settled + self._unsettled, None)

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
