"""A large request body is decoded and checked in a worker thread: the event loop the engine and
every other request share goes on (``/health`` answers) while it is tokenized."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from http_kit import client, serving

from hicache.models.byte_tokenizer import ByteTokenizer
from hicache.server.request_body import PARSE_IN_THREAD_BYTES

SLOW_S = 0.5


class SlowBytes(ByteTokenizer):
    """UTF-8 bytes, encoded slowly (as a long prompt is), noting the thread that encodes."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, text: str) -> Any:
        self.threads.append(threading.get_ident())
        if len(text) > 100:
            time.sleep(SLOW_S)
        return super().encode(text)


async def test_a_large_body_is_parsed_off_the_event_loop() -> None:
    tokenizer = SlowBytes()
    async with serving(None, tokenizer=tokenizer) as server:
        loop_thread = threading.get_ident()
        async with client(server) as http:
            small = await http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1})
            assert small.status_code == 200, small.text
            assert tokenizer.threads == [loop_thread]  # a small body stays on the fast path
            body = {"prompt": "a" * PARSE_IN_THREAD_BYTES, "max_tokens": 1}
            large = asyncio.create_task(http.post("/v1/completions", json=body))
            while len(tokenizer.threads) < 2:  # the large prompt is being tokenized
                await asyncio.sleep(0.005)
            began = time.perf_counter()
            health = await http.get("/health")
            waited = time.perf_counter() - began
            assert health.status_code == 200 and not large.done()
            assert waited < SLOW_S / 2, waited
            assert (await large).status_code == 400  # longer than the device pool
        assert tokenizer.threads[1] != loop_thread
