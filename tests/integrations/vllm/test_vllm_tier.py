"""HiCacheTier built through vLLM's own SecondaryTierFactory, over real hicache backends.

Runs in the vLLM venv (``.venv-vllm``); skips where vLLM is not installed. Helpers in vllm_kit.py,
fixtures in conftest.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

# A submodule, not "vllm": where tests/integrations is on sys.path (pytest puts it there for
# the test files beside this folder), "vllm" alone is this folder, as a namespace package.
pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base",
    reason="vLLM is installed only in the vLLM venv (make test-vllm)",
)

from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.base import JobResult
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm_kit import (
    CHUNK,
    CTX,
    NUM_CHUNKS,
    Primary,
    done,
    fill,
    job,
    key,
    make_spec,
    settle,
    store,
)

from hicache.integrations.vllm import HiCacheTier


def test_round_trip_into_other_chunks(contract_url: str, make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier(contract_url)
    keys = [key(1), key(2), key(3)]
    expected = fill(primary, [0, 1, 2])
    store(tier, primary, keys)
    primary[:] = 0
    tier.submit_load(job(2, keys, [5, 6, 7], load=True))
    (result,) = done(tier)
    assert result == JobResult(2, True, None, result.transfer_time, 3 * CHUNK)
    assert np.array_equal(primary[5:8], expected)
    assert not primary[:5].any()


def test_miss_and_lookup_states(contract_url: str, make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier(contract_url)
    fill(primary, [0])
    page_key = key(9)  # stored behind the tier's back: only a probe can find it
    name = tier._names.name(page_key)
    from hicache.codec import encode_page

    page = encode_page(name, memoryview(primary[0]), tier._meta)
    assert tier._loop.run(tier._backend.put([name], [page]))[0]
    assert tier.lookup(page_key, CTX) is LookupResult.RETRY
    assert tier.lookup(key(10), CTX) is LookupResult.RETRY
    assert settle(tier, [page_key, key(10)]) == [LookupResult.HIT, LookupResult.MISS]
    tier.submit_load(job(1, [key(11)], [3], load=True))
    (result,) = done(tier)
    assert not result.success and not result.successful_keys


def test_several_jobs_and_empty_batch(contract_url: str, make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier(contract_url)
    expected = fill(primary, [0, 1, 2, 3])
    for j in range(4):
        tier.submit_store(job(j, [key(j)], [j], load=False))
    tier.submit_store(job(10, [], [], load=False))
    tier.submit_load(job(11, [], [], load=True))
    results = done(tier)
    assert sorted(r.job_id for r in results) == [0, 1, 2, 3, 10, 11]
    assert all(r.success for r in results)
    primary[:] = 0
    for j in range(4):
        tier.submit_load(job(20 + j, [key(j)], [7 - j], load=True))
    assert all(r.success for r in done(tier))
    assert np.array_equal(primary[[7, 6, 5, 4]], expected)
    assert tier.get_finished_jobs() == []


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_partial_load(contract_url: str, make_tier: Callable[..., Primary], damage: str) -> None:
    tier, primary = make_tier(contract_url)
    keys = [key(1), key(2), key(3)]
    expected = fill(primary, [0, 1, 2])
    store(tier, primary, keys)
    name = tier._names.name(keys[1])
    if damage == "missing":
        assert tier._loop.run(tier._backend.delete([name]))[0]
    else:
        stored = tier._loop.run(tier._backend.get([name]))[0]
        bad = bytearray(stored)
        bad[-1] ^= 0xFF
        assert tier._loop.run(tier._backend.put([name], [[bytes(bad)]]))[0]
    tier.submit_load(job(2, keys, [5, 6, 7], load=True))
    (result,) = done(tier)
    assert not result.success
    assert list(result.successful_keys or []) == [keys[0], keys[2]]
    assert np.array_equal(primary[[5, 7]], expected[[0, 2]])
    assert tier._loop.run(tier._backend.exists([name])) == [False]  # the bad page is gone
    assert tier.lookup(keys[1], CTX) is LookupResult.MISS


def test_drain_and_shutdown(contract_url: str, make_tier: Callable[..., Primary]) -> None:
    tier, primary = make_tier(contract_url)
    fill(primary, list(range(NUM_CHUNKS)))
    for j in range(NUM_CHUNKS):
        tier.submit_store(job(j, [key(100 + j)], [j], load=False))
    tier.drain_jobs()  # every job has ended: all results are there, nothing is pending
    assert sorted(r.job_id for r in tier.get_finished_jobs()) == list(range(NUM_CHUNKS))
    assert not tier.has_pending_work()
    tier.submit_store(job(99, [key(200)], [0], load=False))
    tier.shutdown()  # waits for the queued store
    assert tier._loop.closed
    assert [r.job_id for r in tier.get_finished_jobs()] == [99]
    assert tier.lookup(key(300), CTX) is LookupResult.MISS  # closed: nothing to find
    tier.shutdown()  # idempotent


def test_second_tier_sees_first(shared_url: str, make_tier: Callable[..., Primary]) -> None:
    first, primary = make_tier(shared_url)
    keys = [key(1), key(2)]
    expected = fill(primary, [0, 1])
    store(first, primary, keys)
    second, other = make_tier(shared_url)
    assert second.lookup(keys[0], CTX) is LookupResult.RETRY
    assert settle(second, keys) == [LookupResult.HIT, LookupResult.HIT]
    second.submit_load(job(1, keys, [3, 4], load=True))
    assert done(second)[0].success
    assert np.array_equal(other[3:5], expected)


@pytest.mark.parametrize(
    "spec_kw", [{"rank": 1, "tp": 2}, {"tp": 2}, {"dtype": "bfloat16"}, {"model": "other-model"}]
)
def test_other_format_never_hits(
    shared_url: str, make_tier: Callable[..., Primary], spec_kw: dict[str, Any]
) -> None:
    first, primary = make_tier(shared_url)
    fill(primary, [0])
    store(first, primary, [key(1)])
    other, _ = make_tier(shared_url, **spec_kw)
    assert settle(other, [key(1)]) == [LookupResult.MISS]
    other.submit_load(job(1, [key(1)], [0], load=True))
    assert not done(other)[0].success


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("url", ""),
        ("url", "nosuchbackend://x"),
        ("url", "memory://?capacty=1"),
        ("n_read_threads", 0),
        ("n_write_threads", True),
        ("io_timeout_s", float("nan")),
        ("locality", "nearby"),
        ("enable_kv_events", "yes"),
        ("read_threads", 4),  # not an option (vLLM's name is n_read_threads)
    ],
)
def test_bad_option_names_it(option: str, value: object) -> None:
    spec = make_spec("memory://")
    view = memoryview(np.zeros((NUM_CHUNKS, CHUNK), dtype=np.uint8))
    config: dict[str, object] = {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm"}
    config["url"] = "memory://"
    config[option] = value  # the url last: a bad url replaces the good one
    with pytest.raises(ValueError, match=option):
        SecondaryTierFactory.create_secondary_tier(config, view, spec)


def test_a_missing_url_names_it() -> None:
    spec = make_spec("memory://")
    view = memoryview(np.zeros((NUM_CHUNKS, CHUNK), dtype=np.uint8))
    config = {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm"}
    with pytest.raises(ValueError, match="'url'"):
        SecondaryTierFactory.create_secondary_tier(config, view, spec)


def test_import_is_lazy() -> None:
    import subprocess
    import sys

    code = "import sys, hicache.integrations.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert asyncio.iscoroutinefunction(HiCacheTier._probe)
