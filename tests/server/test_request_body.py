"""Checking a ``/v1/completions`` body: what is served, and a clear 400 for everything else."""

from __future__ import annotations

import math
from typing import Any

import pytest

from hicache.models.byte_tokenizer import ByteTokenizer
from hicache.server.request_body import (
    MIN_CHARS_PER_TOKEN,
    ApiError,
    ServedModel,
    chars_per_token,
    parse_completion,
    parse_json,
)

MODEL = ServedModel("tiny", vocab_size=100)


class WordTokenizer:
    """A stand-in with the one call the parser makes: each word's length as its id."""

    class Encoding:
        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

    def encode(self, text: str) -> Encoding:
        return self.Encoding([len(word) for word in text.split()])


def test_defaults_follow_openai() -> None:
    args = parse_completion({"prompt": [1, 2, 3]}, MODEL)
    assert args.prompt == [1, 2, 3]
    assert (args.max_tokens, args.temperature, args.stream) == (16, 1.0, False)


def test_every_field_that_is_served() -> None:
    body = {"model": "tiny", "prompt": [5], "max_tokens": 3, "temperature": 0, "stream": True,
            "n": 1, "user": "u1"}  # fmt: skip
    args = parse_completion(body, MODEL)
    assert (args.prompt, args.max_tokens, args.temperature, args.stream) == ([5], 3, 0.0, True)


def test_sampling_and_stop_fields() -> None:
    model = ServedModel("tiny", 100, WordTokenizer())
    body = {"prompt": [5], "top_p": 0.5, "seed": -3, "stop": ["x", "yy"], "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    args = parse_completion(body, model)
    assert (args.top_p, args.seed, args.stop, args.include_usage) == (0.5, -3, ("x", "yy"), True)
    assert parse_completion({"prompt": [5], "stop": "z"}, model).stop == ("z",)
    for stop in ([], ["a"] * 5, [""], [7], "x" * 257):
        with pytest.raises(ApiError, match="stop must be"):
            parse_completion({"prompt": [5], "stop": stop}, model)


def test_a_text_prompt_goes_through_the_tokenizer() -> None:
    model = ServedModel("tiny", 100, WordTokenizer())
    assert parse_completion({"prompt": "a bbb cc"}, model).prompt == [1, 3, 2]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ([1, 2], None, "JSON object"),
        ({"prompt": [1], "logit_bias": {}}, "logit_bias", "unknown field"),
        ({"prompt": [1], "stop": "\n"}, "stop", "no tokenizer"),  # a stop is text
        ({"prompt": [1], "top_p": 0}, "top_p", r"\(0, 1\]"),
        ({"prompt": [1], "top_p": 1.5}, "top_p", r"\(0, 1\]"),
        ({"prompt": [1], "seed": 1.5}, "seed", "64-bit"),
        ({"prompt": [1], "seed": 1 << 64}, "seed", "64-bit"),
        ({"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options", "only"),
        ({"prompt": [1], "model": "other"}, "model", "not served"),
        ({"max_tokens": 3}, "prompt", "required"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": "hello"}, "prompt", "no tokenizer"),
        ({"prompt": [1, 100]}, "prompt", "outside the vocabulary"),
        ({"prompt": [1, -1]}, "prompt", "outside the vocabulary"),
        ({"prompt": [1, True]}, "prompt", "list of token ids"),
        ({"prompt": [1.5]}, "prompt", "list of token ids"),
        ({"prompt": ["a", "b"]}, "prompt", "list of token ids"),
        ({"prompt": [1], "max_tokens": 0}, "max_tokens", "at least 1"),
        ({"prompt": [1], "max_tokens": -5}, "max_tokens", "at least 1"),
        ({"prompt": [1], "max_tokens": "8"}, "max_tokens", "integer"),
        ({"prompt": [1], "max_tokens": True}, "max_tokens", "integer"),
        ({"prompt": [1], "temperature": -0.1}, "temperature", "[0, 2]"),
        ({"prompt": [1], "temperature": 2.5}, "temperature", "[0, 2]"),
        ({"prompt": [1], "temperature": math.nan}, "temperature", "[0, 2]"),
        ({"prompt": [1], "temperature": "hot"}, "temperature", "[0, 2]"),
        ({"prompt": [1], "stream": "yes"}, "stream", "true or false"),
        ({"prompt": [1], "n": 2}, "n", "n must be 1"),
    ],
)
def test_bad_bodies_name_what_is_wrong(body: Any, param: str | None, words: str) -> None:
    with pytest.raises(ApiError, match=words if words != "[0, 2]" else r"\[0, 2\]") as caught:
        parse_completion(body, MODEL)
    assert caught.value.param == param and caught.value.status == 400
    error = caught.value.body()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"{not json", "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"n": ' + b"7" * 5000 + b"}", "not JSON"),  # int() refuses over 4,300 digits
        (b"\xff{}", "not JSON"),
    ],
)
def test_a_body_python_cannot_hold_is_a_400(raw: bytes, words: str) -> None:
    with pytest.raises(ApiError, match=words) as refused:
        parse_json(raw)
    assert refused.value.status == 400


class CountingBytes(ByteTokenizer):
    """UTF-8 bytes, counting the texts it encodes."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str) -> Any:
        self.encoded += 1
        return super().encode(text)


def test_a_prompt_longer_than_the_context_is_refused_before_the_tokenizer() -> None:
    tokenizer = CountingBytes()
    model = ServedModel("tiny", 256, tokenizer, context_tokens=8)
    assert model.max_prompt_chars == 8  # a character is at least one byte: one token
    with pytest.raises(ApiError, match="9 characters cannot fit the context of 8") as refused:
        parse_completion({"prompt": "x" * 9}, model)
    assert refused.value.param == "prompt" and tokenizer.encoded == 0
    assert parse_completion({"prompt": "x" * 8}, model).prompt == [ord("x")] * 8
    with pytest.raises(ApiError, match="16 tokens do not fit the context of 8"):
        parse_completion({"prompt": "é" * 8}, model)  # 8 characters, 16 bytes
    assert tokenizer.encoded == 2
    with pytest.raises(ApiError, match="9 tokens do not fit"):
        parse_completion({"prompt": [1] * 8 + ["x"]}, model)  # counted before it is walked
    assert parse_completion({"prompt": [1] * 8}, model).prompt == [1] * 8
    unbounded = ServedModel("tiny", 256, CountingBytes())  # no context: the engine's check
    assert unbounded.max_prompt_chars is None
    assert len(parse_completion({"prompt": "x" * 100}, unbounded).prompt) == 100


def test_a_vocabularys_longest_entry_bounds_the_characters_of_a_token() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    long_word = "w" * 50
    vocab = {"<unk>": 0, "a": 1, long_word: 2}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert chars_per_token(tokenizer) == 100  # doubled for a normalizer's composing
    model = ServedModel("tiny", 3, tokenizer, context_tokens=2)
    assert model.max_prompt_chars == 200
    assert parse_completion({"prompt": f"{long_word} {long_word}"}, model).prompt == [2, 2]
    with pytest.raises(ApiError, match="characters cannot fit"):
        parse_completion({"prompt": "a" * 201}, model)
    tokenizer = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    assert chars_per_token(tokenizer) == MIN_CHARS_PER_TOKEN  # its words may be unknown ones
    assert chars_per_token(ByteTokenizer()) == 1
