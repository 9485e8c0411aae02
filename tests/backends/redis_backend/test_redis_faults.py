"""``redis://`` when things go wrong: damaged values, eviction, killed connections, a stopped
server, timeouts, expiry, a cluster master down; and that a batch is one pipeline per server.

Damage is done the way another tool would do it, through ``redis-cli``; the page codec (and the
``verify`` tool) must then see a miss, never a page.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from typing import Any

import pytest
from cli_kit import run
from redis_kit import open_redis, wait_cluster_ok

from hicache.backends.base import MISS
from hicache.backends.redis import RedisBackend
from hicache.backends.redis.client import MAX_STRIPES, stripe_runs
from hicache.backends.redis.pages import READ_WINDOW
from hicache.codec import decode_page
from hicache.errors import BackendUnavailableError, CodecError
from hicache.keys import RadixKey
from hicache.tools.bench.stores.store_tools import page_scheme, write_chain
from hicache.tools.services.redis import RedisCluster, RedisServer, redis_executable
from hicache.tools.store.scan import Problem
from hicache.tools.store.verify import VerifyOptions, verify_store


def _rkey(backend: RedisBackend, key: str) -> str:
    return backend.config.key_prefix + key


async def _pages(backend: RedisBackend, n: int, payload_bytes: int = 4096) -> list[str]:
    """``n`` pages of one chain, written through the real write path."""
    payloads = [bytes([i]) * payload_bytes for i in range(n)]
    tokens = list(range(n * 16))
    return await write_chain(backend, page_scheme(), RadixKey(tokens), list(payloads))


def _counted(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


# ----- damaged values ---------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_value_damaged_by_another_tool_is_a_miss(
    backend: RedisBackend, single_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = await _pages(backend, 4)
    for key, data in zip(keys, await backend.get(keys), strict=True):
        decode_page(key, data)  # all good as written
    single_server.cli("SET", _rkey(backend, keys[1]), "not a page at all " * 20)
    # Cut short: a SET that stopped half-way, or a tool that kept only the start.
    cut = "redis.call('SET', KEYS[1], string.sub(redis.call('GET', KEYS[1]), 1, 300))"
    single_server.cli("EVAL", cut, "1", _rkey(backend, keys[2]))
    got = await backend.get(keys)
    decode_page(keys[0], got[0])
    for key, data in zip(keys[1:3], got[1:3], strict=True):
        with pytest.raises(CodecError):
            decode_page(key, data)
    report = await verify_store(backend, VerifyOptions())
    assert {b.key: b.problem for b in report.bad} == {
        keys[1]: Problem.FOREIGN,
        keys[2]: Problem.TRUNCATED,
    }
    # The command line, through the URL: the same two, and exit status 1.
    url = single_server.url(key_prefix=backend.config.key_prefix)
    # In a thread: the command runs its own event loop.
    code, out, err = await asyncio.to_thread(
        run, capsys, "verify", url, "--json", "--processes", "1"
    )
    assert code == 1 and out.count('"key"') == 2, (out, err)
    code, out, _ = await asyncio.to_thread(run, capsys, "compact", url, "--quiet")
    assert code == 0
    assert await backend.exists(keys) == [True, False, False, True]


# ----- eviction and a full server ---------------------------------------------------------------
@pytest.mark.asyncio
async def test_evicted_pages_are_misses_and_a_full_server_fails_puts(
    own_server: RedisServer,
) -> None:
    own_server.cli("CONFIG", "SET", "maxmemory", "2mb")
    own_server.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    async with await open_redis(own_server.url()) as backend:
        keys = [f"ev-{i:03d}" for i in range(64)]  # 4 MiB of values into 2 MiB
        for lo in range(0, 64, 8):
            assert await backend.put(keys[lo : lo + 8], [bytes(64 << 10)] * 8) == [True] * 8
        present = await backend.exists(keys)
        assert not all(present) and present[-1], "LRU keeps the newest"
        before = await backend.stats()
        buffers = [bytearray(64 << 10) for _ in keys]
        got = await backend.get_into(keys, buffers)
        # Reading may evict more (reply buffers count as memory), never bring a page back.
        hits = [n != MISS for n in got]
        assert any(hits) and all(p for p, hit in zip(present, hits, strict=True) if hit)
        assert all(buf == bytes(64 << 10) for buf, hit in zip(buffers, hits) if hit)
        assert _counted(before, await backend.stats()).get("errors") is None
        own_server.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
        before = await backend.stats()
        assert await backend.put(["full"], [bytes(4 << 20)]) == [False]  # OOM, not raised
        counted = _counted(before, await backend.stats())
        assert counted["put_errors"] == 1 and counted["put_failures"] == 1
        assert await backend.exists(["full"]) == [False]


# ----- connections and the server going away ----------------------------------------------------
@pytest.mark.asyncio
async def test_killed_connections_are_made_again_without_a_miss(
    backend: RedisBackend, single_server: RedisServer
) -> None:
    assert await backend.put(["ck-1", "ck-2"], [b"one", b"two"]) == [True, True]
    listed = single_server.cli("CLIENT", "LIST", "TYPE", "normal")
    ours = [
        line.split()[0].removeprefix("id=")
        for line in listed.splitlines()
        if " name=hicache " in f" {line} "
    ]
    assert ours, "hicache names its connections"
    for client_id in ours:
        single_server.cli("CLIENT", "KILL", "ID", client_id)
    before = await backend.stats()
    assert await backend.get(["ck-1", "ck-2"]) == [b"one", b"two"]
    assert await backend.exists(["ck-1"]) == [True]
    assert _counted(before, await backend.stats()).get("errors") is None


@pytest.mark.asyncio
async def test_a_stopped_server_gives_misses_and_counted_errors(
    own_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with await open_redis(own_server.url(timeout="1")) as backend:
        assert await backend.put(["st-1"], [b"page"]) == [True]
        own_server.stop()
        caplog.set_level(logging.DEBUG, logger="hicache.backends.redis")
        started = time.monotonic()
        assert await backend.exists(["st-1", "st-2"]) == [False, False]
        assert await backend.get_into(["st-1"], [bytearray(4)]) == [MISS]
        assert await backend.peek(["st-1"], 2) == [None]
        assert await backend.put(["st-3"], [b"x"]) == [False]
        assert await backend.put_missing(["st-3"], [b"x"]) == [False]
        assert await backend.delete(["st-1"]) == [False]
        assert time.monotonic() - started < 5, "a refused connection fails fast"
        stats = await backend.stats()
        assert stats["errors"] == 7 and stats["read_errors"] == 2 and stats["put_errors"] == 2
        with pytest.raises(BackendUnavailableError):  # a listing cannot pass for a whole one
            [info async for info in backend.scan()]
        assert (await backend.stats())["scan_errors"] == 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, "one warning per outage"
        own_server.start()  # empty again: nothing is saved
        assert await backend.put(["st-1"], [b"back"]) == [True]
        assert await backend.get(["st-1"]) == [b"back"]
        assert any("answers again" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_a_reply_later_than_the_timeout_is_a_miss(single_server: RedisServer) -> None:
    async with await open_redis(single_server.url(key_prefix="slow:", timeout="0.3")) as backend:
        assert await backend.put(["slow"], [b"v"]) == [True]
        # DEBUG SLEEP blocks the whole server, as a long command or a fork would.
        cli = redis_executable("redis-cli")
        sleeper = subprocess.Popen([cli, "-p", str(single_server.port), "DEBUG", "SLEEP", "1"])
        try:
            await asyncio.sleep(0.1)
            assert await backend.get(["slow"]) == [None]
        finally:
            sleeper.wait(10)
        assert (await backend.stats())["read_errors"] >= 1
        assert await backend.get(["slow"]) == [b"v"]


# ----- expiry -------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_ttl_is_set_by_puts_renewed_by_reads_and_expiry_is_a_miss(
    single_server: RedisServer,
) -> None:
    async with await open_redis(single_server.url(key_prefix="ttl:", ttl="100")) as backend:
        assert await backend.put(["t1", "t2"], [b"a", b"b"]) == [True, True]
        assert await backend.put_missing(["t3"], [b"c"]) == [True]
        for key in ("t1", "t2", "t3"):
            assert 95 <= int(single_server.cli("TTL", f"ttl:{key}")) <= 100
        single_server.cli("EXPIRE", "ttl:t1", "5")
        assert await backend.get(["t1"]) == [b"a"]
        assert int(single_server.cli("TTL", "ttl:t1")) > 50, "a read renews the ttl"
        single_server.cli("PEXPIRE", "ttl:t2", "1")
        await asyncio.sleep(0.05)
        assert await backend.get(["t2"]) == [None]
        assert await backend.exists(["t2"]) == [False]


# ----- batches ------------------------------------------------------------------------------------
def _count_pipelines(backend: RedisBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the pipelines a batch sends: redis-py's, and the exchanges on hicache's own
    connections (page GETs and SETs)."""
    made: list[int] = []
    for owner, name in ((backend._client.client, "pipeline"), (backend._client.direct, "run")):
        real = getattr(owner, name)

        def counting(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            made.append(1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)
    return made


@pytest.mark.asyncio
async def test_a_batch_is_one_pipeline(
    backend: RedisBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _count_pipelines(backend, monkeypatch)
    keys = [f"b-{i}" for i in range(32)]
    assert await backend.put(keys, [b"v"] * 32) == [True] * 32
    await backend.exists(keys)
    await backend.get(keys, size_hint=8)
    await backend.put_missing(keys, [b"v"] * 32)
    await backend.delete(keys)
    assert len(made) == 5


@pytest.mark.asyncio
async def test_a_batch_of_large_values_is_cut_into_a_few_pipelines_by_bytes(
    backend: RedisBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _count_pipelines(backend, monkeypatch)
    size = 1 << 20  # under the shared server's proto-max-bulk-len
    keys = [f"l-{i}" for i in range(10)]
    values = [bytes([i]) * size for i in range(10)]
    assert await backend.put(keys, values) == [True] * 10
    assert len(made) == 3  # 10 MiB in runs of STRIPE_BYTES (4 MiB): 4 + 4 + 2
    buffers = [bytearray(size) for _ in keys]
    assert await backend.get_into(keys, buffers) == [size] * 10
    assert [bytes(b) for b in buffers] == values  # each reply back in its own key's buffer
    # The reads: the same three stripes, each asking READ_WINDOW (1 MiB, one value) at a time.
    assert size == READ_WINDOW and len(made) == 3 + 10
    assert len(stripe_runs(list(range(64)), [16 << 20] * 64)) == MAX_STRIPES  # at most this many
    assert stripe_runs([3, 1, 2], None) == [[3, 1, 2]]


@pytest.mark.asyncio
async def test_a_cluster_batch_is_one_pipeline_per_master_and_a_dead_master_fails_only_its_keys(
    cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with await open_redis(cluster.url(key_prefix="spread:", timeout="1")) as backend:
        keys = [f"c-{i}" for i in range(30)]
        made = _count_pipelines(backend, monkeypatch)
        assert await backend.put(keys, [b"v"] * 30) == [True] * 30
        assert len(made) == 3
        counts = [int(n.cli("DBSIZE")) for n in cluster.nodes]
        assert all(counts), f"keys spread over every master: {counts}"
        victim = cluster.nodes[2]
        on_victim = set(victim.cli("--scan", "--pattern", "spread:*").split())
        victim.kill()
        try:
            present = await backend.exists(keys)
            assert present == [f"spread:{k}" not in on_victim for k in keys]
            assert (await backend.stats())["exists_errors"] == len(on_victim)
        finally:
            victim.start()
            wait_cluster_ok(cluster)


@pytest.mark.asyncio
async def test_scan_lists_only_this_stores_pages(
    backend: RedisBackend, single_server: RedisServer
) -> None:
    keys = await _pages(backend, 3, payload_bytes=100)
    prefix = backend.config.key_prefix
    single_server.cli("SET", f"{prefix}bad key with spaces", "x")  # not a valid key: skipped
    single_server.cli("HSET", f"{prefix}a-hash", "f", "v")  # not a string value: skipped
    single_server.cli("SET", "other:k", "not ours")
    listed = {info.key: info.size async for info in backend.scan()}
    assert sorted(listed) == sorted(keys)
    assert set(listed.values()) == {160 + 100}
