"""Chat bodies: templates loaded as transformers reads them, rendered in a sandbox."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from test_request_body import CountingBytes

from hicache.errors import CheckpointError
from hicache.models.byte_tokenizer import ByteTokenizer
from hicache.server.chat import load_chat_template, parse_chat, render_chat
from hicache.server.request_body import ApiError, ChatTemplate, ServedModel

MODEL = ServedModel("tiny", 1000, ByteTokenizer())
USER = [{"role": "user", "content": "hi"}]


def test_a_checkpoints_template_and_its_tokens_are_used(tmp_path: pathlib.Path) -> None:
    source = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    config = {"chat_template": [{"name": "tool_use", "template": "x"},
                                {"name": "default", "template": source}],
              "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = load_chat_template(tmp_path)
    assert template == ChatTemplate(source, "<s>", "</s>")
    assert render_chat(template, USER) == "<s>[user]hi"
    assert load_chat_template(tmp_path / "none") == ChatTemplate()  # no file: the plain one
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        load_chat_template(tmp_path)


@pytest.mark.parametrize(
    "source",
    ["{{ ''.__class__.__mro__ }}", "{{ raise_exception('no system messages') }}",
     "{% for %}"],
)  # fmt: skip
def test_a_template_that_fails_or_reaches_python_internals_is_a_400(source: str) -> None:
    with pytest.raises(ApiError, match="chat template") as caught:
        render_chat(ChatTemplate(source), USER)
    assert caught.value.status == 400 and "__mro__" not in str(caught.value).split(":")[0]


def test_chat_bodies() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    args = parse_chat(
        {"messages": [{"role": "user", "content": parts}], "max_completion_tokens": 3}, MODEL
    )
    assert bytes(args.prompt).decode() == "<|user|>\nab\n<|assistant|>\n"
    assert args.max_tokens == 3
    for body, words in (
        ({"messages": []}, "1 to"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"messages": [{"role": [], "content": "x"}]}, "role"),  # unhashable: a 500 before
        ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "role"),
        ({"messages": ["user"]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "text"),
        ({"messages": USER, "max_tokens": 2, "max_completion_tokens": 2}, "not both"),
        ({"messages": USER, "prompt": "x"}, "unknown field"),
    ):
        with pytest.raises(ApiError, match=words):
            parse_chat(body, MODEL)
    with pytest.raises(ApiError, match="no tokenizer"):
        parse_chat({"messages": USER}, ServedModel("tiny", 1000))


def test_a_template_is_compiled_once_for_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    from_string = ImmutableSandboxedEnvironment.from_string

    def counted(env: ImmutableSandboxedEnvironment, source: str, *args: Any) -> Any:
        compiled.append(source)
        return from_string(env, source, *args)

    monkeypatch.setattr(ImmutableSandboxedEnvironment, "from_string", counted)
    source = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{# compiled once #}"
    model = ServedModel("tiny", 1000, ByteTokenizer(), ChatTemplate(source))
    for i in range(50):
        body = {"messages": [{"role": "user", "content": f"hi {i}"}]}
        assert bytes(parse_chat(body, model).prompt).decode() == f"hi {i}|"
    broken = ChatTemplate("{% for %}{# broken once #}")
    for _ in range(5):  # its failure is kept too
        with pytest.raises(ApiError, match="chat template"):
            render_chat(broken, USER)
    assert compiled == [source, broken.source]


def test_messages_longer_than_the_context_are_refused_before_the_tokenizer() -> None:
    tokenizer = CountingBytes()
    model = ServedModel("tiny", 1000, tokenizer, context_tokens=40)
    long = [{"role": "user", "content": "x" * 30}, {"role": "user", "content": "y" * 11}]
    with pytest.raises(ApiError, match="41 characters cannot fit the context of 40") as refused:
        parse_chat({"messages": long}, model)  # the messages' text alone
    assert refused.value.param == "messages"
    rendered = [{"role": "user", "content": "x" * 30}]  # 30, and 24 of the template's own
    with pytest.raises(ApiError, match="54 characters cannot fit"):
        parse_chat({"messages": rendered}, model)
    assert tokenizer.encoded == 0
    fits = [{"role": "user", "content": "x" * 16}]
    assert len(parse_chat({"messages": fits}, model).prompt) == 40
    assert tokenizer.encoded == 1
