"""``/v1/chat/completions`` bodies: ``messages`` rendered into a prompt by a chat template.

The template is the checkpoint's (``tokenizer_config.json``'s ``chat_template``: a string, or a
list of named templates of which ``default`` is used), rendered as transformers renders it: a
sandboxed Jinja environment (no attribute access to Python internals, no file system) with
``trim_blocks`` and ``lstrip_blocks``, given ``messages``, ``add_generation_prompt=True``, the
tokenizer's ``bos_token`` / ``eos_token`` and a ``raise_exception`` function. A model without
one uses :data:`~hicache.server.request_body.PLAIN_TEMPLATE`: each message as ``<|ROLE|>`` on a
line of its own followed by its content and a newline, then ``<|assistant|>`` and a newline.

A template is compiled once (the last few sources are kept compiled, a failure included) and
rendered by every request; a compiled Jinja template renders from several threads at once.
With a context (``ServedModel.context_tokens``), messages are refused before rendering when
their text alone (which the rendered prompt holds) has more characters than the context can
hold, and before the tokenizer when the rendered prompt has.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hicache.errors import CheckpointError
from hicache.server.request_body import (
    COMMON_FIELDS,
    ApiError,
    ChatTemplate,
    CompletionArgs,
    ServedModel,
    check_fields,
    check_prompt_ids,
    check_text_length,
    completion_args,
)

__all__ = ["load_chat_template", "parse_chat", "render_chat"]

_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_MAX_MESSAGES = 4096
_MAX_CONFIG_BYTES = 16 << 20
_COMPILED_TEMPLATES = 8  # a server has one; tests and tools may render a few others


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    return env


@functools.lru_cache(maxsize=_COMPILED_TEMPLATES)
def _compiled(source: str) -> Template | str:
    """``source`` compiled, or why it does not compile (kept too: a broken template costs one
    compilation, not one per request)."""
    try:
        return _environment().from_string(source)
    except TemplateError as exc:
        return str(exc)


def render_chat(template: ChatTemplate, messages: list[dict[str, Any]]) -> str:
    """``messages`` through ``template``; an :class:`ApiError` when the template refuses them
    (its ``raise_exception``) or fails."""
    compiled = _compiled(template.source)
    try:
        if isinstance(compiled, str):
            raise TemplateError(compiled)
        return compiled.render(
            messages=messages, add_generation_prompt=True,
            bos_token=template.bos_token, eos_token=template.eos_token,
        )  # fmt: skip
    except TemplateError as exc:
        raise ApiError(f"the chat template refused these messages: {exc}", "messages") from None


def load_chat_template(directory: pathlib.Path) -> ChatTemplate:
    """The chat template of a checkpoint directory; :data:`PLAIN_TEMPLATE` when it has none."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return ChatTemplate()
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read(_MAX_CONFIG_BYTES))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return ChatTemplate()
    if not isinstance(source, str):
        raise CheckpointError(f"{path}: chat_template must be a string")
    return ChatTemplate(source, _token(config, "bos_token"), _token(config, "eos_token"))


def _token(config: dict[str, Any], name: str) -> str:
    value = config.get(name)
    if isinstance(value, dict):  # an AddedToken written out
        value = value.get("content")
    return value if isinstance(value, str) else ""


def parse_chat(body: Any, model: ServedModel) -> CompletionArgs:
    """Check a decoded ``/v1/chat/completions`` body and render its prompt."""
    check_fields(body, _FIELDS, model)
    if model.tokenizer is None:
        raise ApiError("chat needs text: this model has no tokenizer", "messages")
    messages = _messages(body.get("messages"))
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise ApiError("give max_completion_tokens or max_tokens, not both", "max_tokens")
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    check_text_length(sum(len(m["content"]) for m in messages), model, "messages")
    prompt = render_chat(model.chat_template, messages)
    check_text_length(len(prompt), model, "messages")  # a template adds text of its own
    ids: list[int] = model.tokenizer.encode(prompt).ids
    check_prompt_ids(ids, model, "messages")
    return completion_args(body, ids, field, model)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not 1 <= len(value) <= _MAX_MESSAGES:
        raise ApiError(f"messages must be a list of 1 to {_MAX_MESSAGES} messages", "messages")
    out = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _ROLES:  # a list or dict is unhashable
            raise ApiError(f"messages[{i}] needs a role of {sorted(_ROLES)}", "messages")
        out.append({"role": role, "content": _content(message.get("content"), i)})
    return out


def _content(value: Any, i: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text"}`` parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        return "".join(p["text"] for p in value)
    raise ApiError(f"messages[{i}].content must be text (a string or text parts)", "messages")
