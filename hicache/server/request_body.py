"""The body of a ``/v1/completions`` request, checked: what the engine serves, or an HTTP 400.

Pure functions over the decoded JSON, so each rule is tested without a server. The fields are
OpenAI's completions fields that this engine implements; any other field is refused by name
rather than ignored (a client that asks for ``stop`` or ``logprobs`` must not get an answer
that silently lacks them).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from hicache.errors import InvalidArgumentError
from hicache.models.byte_tokenizer import ByteTokenizer

__all__ = [
    "parse_body",
    "read_body",
    "COMMON_FIELDS",
    "MIN_CHARS_PER_TOKEN",
    "PARSE_IN_THREAD_BYTES",
    "PLAIN_TEMPLATE",
    "ApiError",
    "ChatTemplate",
    "CompletionArgs",
    "ServedModel",
    "chars_per_token",
    "check_fields",
    "check_prompt_ids",
    "check_text_length",
    "completion_args",
    "parse_completion",
    "parse_json",
    "prompt_ids",
]

# The fields both endpoints take; each adds its prompt's (``prompt``, or ``messages``).
COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
     "n", "user", "priority", "cache_salt"}
)  # fmt: skip
_FIELDS = COMMON_FIELDS | {"prompt"}
MAX_SALT_CHARS = 256
MAX_STOPS = 4  # OpenAI's
MAX_STOP_CHARS = 256
MAX_SEED = (1 << 63) - 1
MAX_PRIORITY = 1 << 20  # priorities are compared, never summed: any range would do
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's; 0 is greedy
MAX_TEMPERATURE = 2.0  # OpenAI's range
# A body this large is decoded and checked in a worker thread: JSON, templates and the tokenizer
# take long enough past it to delay every other request on the event loop.
PARSE_IN_THREAD_BYTES = 64 << 10
# Characters one token stands for at most, for a tokenizer that can drop text (a whitespace
# pre-tokenizer, one unknown token for a whole word): no vocabulary bounds those, so this floor
# is a margin, not a proof. See chars_per_token.
MIN_CHARS_PER_TOKEN = 32
# A normalizer may compose characters before the vocabulary sees them (NFC turns up to 4 code
# points into one 3-byte character): text characters per vocabulary character, rounded up.
_NORMALIZER_SHRINK = 2


def parse_json(raw: bytes) -> Any:
    """A request body's JSON; ApiError (400) for anything that is not JSON Python can hold:
    bad UTF-8 or syntax, nesting deeper than the interpreter's recursion limit, an integer of
    more digits than Python converts (4,300)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError("the request body is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError too
        raise ApiError(f"the request body is not JSON: {exc}") from None


class ApiError(InvalidArgumentError):
    """A request the server refuses: its HTTP status, and the field at fault when one is."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code
        self.retry_after_s = retry_after_s  # a 429 or 503: when a retry may succeed

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 429:
            kind = "rate_limit_error"
        error = {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


# A model without a chat template of its own renders messages with this one (docs/http.md).
PLAIN_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A chat template (Jinja source) and the special tokens it may name."""

    source: str = PLAIN_TEMPLATE
    bos_token: str = ""
    eos_token: str = ""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the endpoint serves: its name, vocabulary, tokenizer (None: token ids only), chat
    template and context (the most prompt tokens the engine takes; None: left to the engine's
    own check). With a context, a prompt that cannot fit it is refused before it is tokenized or
    walked: text of more than ``max_prompt_chars`` characters (``context_tokens`` times
    :func:`chars_per_token`), a list of more than ``context_tokens`` token ids."""

    name: str
    vocab_size: int
    tokenizer: Any = None  # a tokenizers.Tokenizer
    chat_template: ChatTemplate = ChatTemplate()
    context_tokens: int | None = None
    max_prompt_chars: int | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        chars = None
        if self.context_tokens is not None and self.tokenizer is not None:
            chars = self.context_tokens * chars_per_token(self.tokenizer)
        object.__setattr__(self, "max_prompt_chars", chars)


def chars_per_token(tokenizer: Any) -> int:
    """The most characters of text one token of ``tokenizer`` stands for: 1 for UTF-8 bytes
    (every character is at least one byte); for a vocabulary that ``get_vocab`` lists, twice its
    longest entry (a byte-level entry has a character per byte, a SentencePiece one a character
    per character or ``<0xNN>`` per byte: never fewer than the text it matches; doubled for
    normalizers, see _NORMALIZER_SHRINK), and at least MIN_CHARS_PER_TOKEN."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    vocab = getattr(tokenizer, "get_vocab", None)
    longest = max(map(len, vocab()), default=0) if callable(vocab) else 0
    return max(MIN_CHARS_PER_TOKEN, _NORMALIZER_SHRINK * longest)


@dataclass(frozen=True, slots=True)
class CompletionArgs:
    """A checked request: the prompt as token ids and how to generate after it."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    stream: bool
    priority: int = 0  # higher: admitted first; its pages evicted last (--eviction priority)
    cache_salt: str | None = None  # requests share cached pages only with the same salt
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the text ends before the first of these it holds
    include_usage: bool = False  # a stream ends with a chunk holding the usage


def parse_completion(body: Any, model: ServedModel) -> CompletionArgs:
    """Check a decoded ``/v1/completions`` body; :class:`ApiError` names the first thing
    wrong."""
    check_fields(body, _FIELDS, model)
    if "prompt" not in body:
        raise ApiError("prompt is required", "prompt")
    return completion_args(body, _prompt(body["prompt"], model), "max_tokens", model)


def check_fields(body: Any, fields: frozenset[str], model: ServedModel) -> None:
    """A JSON object of ``fields`` only, for this model, asking for one answer."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ApiError(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    name = body.get("model")
    if name is not None and name != model.name:
        raise ApiError(f"model {name!r} is not served here (this server serves {model.name!r})",
                       "model")  # fmt: skip
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise ApiError("n must be 1 (one completion per request)", "n")


def completion_args(
    body: dict[str, Any], prompt: list[int], max_field: str, model: ServedModel
) -> CompletionArgs:
    """The checked arguments of a body whose prompt is ``prompt``; ``max_field`` names the
    field holding the output length (chat also takes ``max_completion_tokens``)."""
    stream = _flag(body.get("stream", False), "stream")
    return CompletionArgs(
        prompt=prompt,
        max_tokens=_max_tokens(body.get(max_field, DEFAULT_MAX_TOKENS), max_field),
        temperature=_temperature(body.get("temperature", DEFAULT_TEMPERATURE)),
        stream=stream,
        priority=_priority(body.get("priority", 0)),
        cache_salt=_salt(body.get("cache_salt")),
        top_p=_top_p(body.get("top_p", 1.0)),
        seed=_seed(body.get("seed")),
        stop=_stops(body.get("stop"), model),
        include_usage=_include_usage(body.get("stream_options"), stream),
    )


def _prompt(prompt: Any, model: ServedModel) -> list[int]:
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ApiError("this model has no tokenizer: send the prompt as token ids", "prompt")
        check_text_length(len(prompt), model, "prompt")
        ids: list[int] = model.tokenizer.encode(prompt).ids
    elif isinstance(prompt, list):
        _check_token_count(len(prompt), model, "prompt")  # before the list is walked
        if not all(_is_int(t) for t in prompt):
            raise ApiError("prompt must be a string or a list of token ids", "prompt")
        ids = list(prompt)
    else:
        raise ApiError("prompt must be a string or a list of token ids", "prompt")
    check_prompt_ids(ids, model, "prompt")
    return ids


def check_text_length(chars: int, model: ServedModel, param: str) -> None:
    """Refuse ``chars`` characters of prompt text that no prompt within the model's context
    holds (see :func:`chars_per_token`)."""
    most = model.max_prompt_chars
    if most is not None and chars > most:
        raise ApiError(f"the prompt's {chars} characters cannot fit the context of "
                       f"{model.context_tokens} tokens (at most {most} characters)",
                       param)  # fmt: skip


def check_prompt_ids(ids: list[int], model: ServedModel, param: str) -> None:
    """Refuse an empty prompt, one past the context, or one with ids outside the vocabulary."""
    if not ids:
        raise ApiError("prompt is empty", param)
    _check_token_count(len(ids), model, param)
    bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise ApiError(f"token id {bad} is outside the vocabulary [0, {model.vocab_size})",
                       param)  # fmt: skip


def _check_token_count(count: int, model: ServedModel, param: str) -> None:
    context = model.context_tokens
    if context is not None and count > context:
        raise ApiError(f"the prompt's {count} tokens do not fit the context of {context} tokens",
                       param)  # fmt: skip


def _max_tokens(value: Any, name: str = "max_tokens") -> int:
    if not _is_int(value) or value < 1:
        raise ApiError(f"{name} must be an integer of at least 1, got {value!r}", name)
    return int(value)


def _top_p(value: Any) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not 0 < value <= 1:
        raise ApiError(f"top_p must be a number in (0, 1], got {value!r}", "top_p")
    return float(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or not -MAX_SEED - 1 <= value <= MAX_SEED:
        raise ApiError(f"seed must be a 64-bit integer, got {value!r}", "seed")
    return int(value)


def _stops(value: Any, model: ServedModel) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    good = (
        isinstance(stops, list)
        and 1 <= len(stops) <= MAX_STOPS
        and all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_CHARS for s in stops)
    )
    if not good:
        raise ApiError(f"stop must be a string or a list of 1 to {MAX_STOPS} strings of 1 to "
                       f"{MAX_STOP_CHARS} characters", "stop")  # fmt: skip
    if model.tokenizer is None:
        raise ApiError("stop needs text: this model has no tokenizer", "stop")
    return tuple(stops)


def _include_usage(value: Any, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise ApiError("stream_options is only for stream: true", "stream_options")
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise ApiError("stream_options takes only include_usage", "stream_options")
    return _flag(value.get("include_usage", False), "stream_options.include_usage")


def _temperature(value: Any) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not 0 <= value <= MAX_TEMPERATURE:
        raise ApiError(
            f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {value!r}",
            "temperature",
        )
    return float(value)


def _priority(value: Any) -> int:
    if not _is_int(value) or not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise ApiError(
            f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {value!r}",
            "priority",
        )
    return int(value)


def _salt(value: Any) -> str | None:
    if value is None:
        return None
    ok = isinstance(value, str) and 1 <= len(value) <= MAX_SALT_CHARS and value.isprintable()
    if not ok:
        raise ApiError(f"cache_salt must be 1 to {MAX_SALT_CHARS} printable characters",
                       "cache_salt")  # fmt: skip
    return str(value)


def prompt_ids(prompt: Any, model: ServedModel) -> list[int]:
    """A prompt (text or token ids) as checked token ids, as ``/v1/completions`` takes it."""
    return _prompt(prompt, model)


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false, got {value!r}", name)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """A request's whole body: a 408 past ``timeout_s``, a 413 past the app's size limit."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError:
        raise ApiError("the request body did not arrive in time", None, 408) from None
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(f"the request body is too large: {exc.text}", None, 413) from None


async def parse_body(raw: bytes, parse: Callable[[Any], CompletionArgs]) -> CompletionArgs:
    """``raw`` decoded and checked by ``parse``: in a worker thread from
    PARSE_IN_THREAD_BYTES on, so that a large body's JSON, template and tokenizer work does not
    hold up the event loop every other request (and a single server's engine) shares."""
    if len(raw) < PARSE_IN_THREAD_BYTES:
        return parse(parse_json(raw))
    return await asyncio.to_thread(lambda: parse(parse_json(raw)))
