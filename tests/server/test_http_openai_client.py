"""The official ``openai`` client against a live server: completions and chat, streamed and
not, the model list, stop strings, seeds, and the client's own exception for each refusal.

The seeded preset serves text as UTF-8 bytes (``ByteTokenizer``) and renders chat messages
with the plain template, as ``hicache serve --http`` does for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from http_kit import serving, start, stop

from hicache.models.byte_tokenizer import ByteTokenizer
from hicache.server.app import HttpServer
from hicache.server.auth import Access, KeyRing
from hicache.server.chat import render_chat
from hicache.server.limits import Limits
from hicache.server.request_body import ChatTemplate

KEY = "sk-client-test-01"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    access = Access(KeyRing({KEY: "tests"}))
    running = await start(None, device_tokens=1024, tokenizer=ByteTokenizer(), access=access,
                          limits=Limits(max_concurrent=8))  # fmt: skip
    yield running
    await stop(running)


def client(server: HttpServer, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


async def test_completions_and_the_model_list(server: HttpServer) -> None:
    api = client(server)
    models = await api.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    done = await api.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason == "length" and isinstance(done.choices[0].text, str)
    assert done.usage is not None and done.usage.completion_tokens == 4
    assert done.usage.prompt_tokens == len("hello")
    again = await api.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert again.choices[0].text == done.choices[0].text  # greedy: the same text
    pieces = []
    stream = await api.completions.create(model="tiny", prompt="hello", max_tokens=4,
                                          temperature=0, stream=True)  # fmt: skip
    async for chunk in stream:
        pieces.append(chunk.choices[0].text)
    assert "".join(pieces) == done.choices[0].text


async def test_chat_renders_the_messages_and_streams_with_usage(server: HttpServer) -> None:
    api = client(server)
    done = await api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    prompt = render_chat(ChatTemplate(), MESSAGES)
    assert prompt == "<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n"
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt.encode())
    stream = await api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


async def test_a_stop_string_ends_the_text_before_it(server: HttpServer) -> None:
    api = client(server)
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    full = (await api.chat.completions.create(**args)).choices[0].message.content or ""  # type: ignore[call-overload]
    k = next(i for i in range(1, len(full) - 1) if full[i : i + 2].isascii())
    word = full[k : k + 2]
    for streamed in (False, True):
        if streamed:
            stream = await api.chat.completions.create(**args, stop=[word], stream=True)  # type: ignore[call-overload]
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            done = await api.chat.completions.create(**args, stop=word)  # type: ignore[call-overload]
            text, finish = done.choices[0].message.content, done.choices[0].finish_reason
        assert text == full[: full.find(word)] and finish == "stop", streamed


async def test_a_seed_makes_a_sampled_answer_repeat(server: HttpServer) -> None:
    api = client(server)
    args = {"model": "tiny", "prompt": "seeded", "max_tokens": 8, "temperature": 1.0}
    first = await api.completions.create(**args, seed=1234, top_p=0.9)  # type: ignore[call-overload]
    second = await api.completions.create(**args, seed=1234, top_p=0.9)  # type: ignore[call-overload]
    assert first.choices[0].text == second.choices[0].text


async def test_refusals_raise_the_clients_own_errors(server: HttpServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        await client(server, "sk-wrong-key-0001").models.list()
    api = client(server)
    with pytest.raises(openai.BadRequestError):
        await api.completions.create(model="tiny", prompt="x", max_tokens=2, top_p=5)
    with pytest.raises(openai.BadRequestError):
        await api.chat.completions.create(model="tiny", messages=[{"role": "nobody"}])  # type: ignore[list-item, typeddict-item]
    access, limits = Access(KeyRing({KEY: "t"})), Limits(rate_per_s=0.5)  # a burst of one
    async with serving(None, tokenizer=ByteTokenizer(), access=access, limits=limits) as slow:
        limited = client(slow)
        await limited.completions.create(model="tiny", prompt="x", max_tokens=1)
        with pytest.raises(openai.RateLimitError):
            await limited.completions.create(model="tiny", prompt="x", max_tokens=1)
