"""What the adapter's namespace keeps apart (ranks, layouts, page sizes, models) and shares
(MLA pages across TP ranks, pages across instances), and what bad input and bad objects do."""

from __future__ import annotations

import asyncio
import logging

import pytest

pytest.importorskip(
    "sglang", reason="SGLang is installed only in the SGLang venv (make test-sglang)"
)

import torch
from sglang.srt.managers.cache_controller import get_storage_hash_str
from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics
from sglang_kit import (
    PAGE,
    create_storage,
    fill_random,
    mha_pools,
    mla_pools,
    page_bytes,
    slots,
)

from hicache.backends.registry import open_backend
from hicache.errors import ConfigError
from hicache.integrations.sglang import extra_config

HASHES = get_storage_hash_str(list(range(7, 7 + 4 * PAGE)), None, page_size=PAGE)
SRC, DST = [1, 2, 3, 4], [8, 9, 10, 11]


def stored(tmp_path, pools=None, seed: int = 1, **config):
    pools = pools or mha_pools("page_first")
    fill_random(pools[1], seed)
    storage = create_storage(extra_config(f"file://{tmp_path}"), pools[1], **config)
    assert all(storage.batch_set_v1(HASHES, slots(SRC)))
    return storage, pools[1]


def reader(tmp_path, pools=None, **config):
    pools = pools or mha_pools("page_first")
    return create_storage(extra_config(f"file://{tmp_path}"), pools[1], **config), pools[1]


def same_pages(a, b) -> bool:
    return all(
        page_bytes(a, s * PAGE) == page_bytes(b, d * PAGE) for s, d in zip(SRC, DST, strict=True)
    )


def test_tp_ranks_do_not_read_each_others_shards(tmp_path) -> None:
    rank0, _ = stored(tmp_path, tp_rank=0, tp_size=2)
    rank1, _ = reader(tmp_path, tp_rank=1, tp_size=2)
    alone, _ = reader(tmp_path, tp_rank=0, tp_size=1)
    assert rank0.batch_exists(HASHES) == 4
    assert rank1.batch_exists(HASHES) == 0 and alone.batch_exists(HASHES) == 0
    for storage in (rank0, rank1, alone):
        storage.close()


def test_mla_pages_are_one_object_shared_by_tp_ranks(tmp_path) -> None:
    rank1, _ = reader(tmp_path, mla_pools("page_first"), mla=True, tp_rank=1, tp_size=2)
    assert all(rank1.batch_set_v1(HASHES, slots(SRC)))  # acknowledged: rank 0 writes
    assert rank1.batch_exists(HASHES) == 0
    rank0, source = stored(tmp_path, mla_pools("page_first"), mla=True, tp_rank=0, tp_size=2)
    assert rank1.batch_exists(HASHES) == 4
    assert all(rank1.batch_get_v1(HASHES, slots(DST)))
    assert same_pages(source, rank1.pools["kv"].host_pool)
    rank0.close()
    rank1.close()


@pytest.mark.parametrize(
    ("other_pools", "other_config"),
    [
        (lambda: mha_pools("layer_first"), {}),
        (lambda: mha_pools("page_first", heads=4), {}),
        (lambda: mha_pools("page_first", page=2 * PAGE), {}),
        (lambda: mha_pools("page_first"), {"model_name": "org/another-model"}),
    ],
    ids=["layout", "heads", "page-size", "model"],
)
def test_another_format_is_a_miss(tmp_path, other_pools, other_config) -> None:
    writer, _ = stored(tmp_path)
    pools = other_pools()
    extra = extra_config(f"file://{tmp_path}", **other_config)
    other = create_storage(extra, pools[1])
    assert other.batch_exists(HASHES) == 0
    assert other.batch_get_v1(HASHES, slots(DST)) == [False] * 4
    writer.close()
    other.close()


def test_a_page_first_page_never_lands_in_a_layer_first_pool(tmp_path) -> None:
    """SGLang's own file backend keys pages by hash and rank only: it would load these bytes."""
    writer, _ = stored(tmp_path)
    layer_first = mha_pools("layer_first")
    before = page_bytes(layer_first[1], DST[0] * PAGE)
    other = create_storage(extra_config(f"file://{tmp_path}"), layer_first[1])
    assert other.get(HASHES[0], layer_first[1].get_dummy_flat_data_page()) is None
    assert other.batch_get_v1(HASHES[:1], slots(DST[:1])) == [False]
    assert page_bytes(layer_first[1], DST[0] * PAGE) == before
    writer.close()
    other.close()


def test_pages_persist_across_instances(tmp_path) -> None:
    writer, source = stored(tmp_path)
    writer.close()
    later, target = reader(tmp_path)
    assert later.batch_get_v1(HASHES, slots(DST)) == [True] * 4
    assert same_pages(source, target)
    later.close()


def test_clear_removes_only_this_namespace(tmp_path) -> None:
    mine, _ = stored(tmp_path)
    theirs = create_storage(
        extra_config(f"file://{tmp_path}", model_name="org/other"), mha_pools("page_first")[1]
    )
    assert all(theirs.batch_set_v1(HASHES, slots(SRC)))
    mine.clear()
    assert mine.batch_exists(HASHES) == 0
    assert theirs.batch_exists(HASHES) == 4
    mine.close()
    theirs.close()


async def _rewrite(tmp_path, change) -> None:
    backend = await open_backend(f"file://{tmp_path}")
    keys = sorted([info.key async for info in backend.scan("sgl-")])
    data = (await backend.get(keys[:1]))[0]
    await backend.put(keys[:1], [change(keys, data)])
    await backend.close()


@pytest.mark.parametrize(
    "change",
    [
        lambda keys, data: data[:-7],  # truncated
        lambda keys, data: data[:200] + bytes([data[200] ^ 1]) + data[201:],  # one bit flipped
        lambda keys, data: b"\x00" * len(data),  # garbage
    ],
    ids=["truncated", "bitflip", "garbage"],
)
def test_a_bad_object_is_a_miss_and_the_next_backup_rewrites_it(tmp_path, change, caplog) -> None:
    storage, source = stored(tmp_path)
    asyncio.run(_rewrite(tmp_path, change))
    results = storage.batch_get_v1(HASHES, slots(DST))
    assert results.count(False) == 1
    bad = results.index(False)
    assert "counted as a miss" in caplog.text
    assert storage.batch_exists(HASHES) == bad  # a known-bad page is not offered again
    assert all(storage.batch_set_v1(HASHES, slots(SRC)))  # the backup rewrites it
    assert storage.batch_get_v1(HASHES, slots(DST)) == [True] * 4
    assert same_pages(source, storage.pools["kv"].host_pool)
    storage.close()


def test_an_object_copied_under_another_key_is_a_miss(tmp_path) -> None:
    storage, _ = stored(tmp_path)

    async def swap() -> None:
        backend = await open_backend(f"file://{tmp_path}")
        keys = sorted([info.key async for info in backend.scan("sgl-")])
        first = (await backend.get(keys[:1]))[0]
        await backend.put(keys[1:2], [first])
        await backend.close()

    asyncio.run(swap())
    assert storage.batch_get_v1(HASHES, slots(DST)).count(False) == 1
    storage.close()


def test_bad_keys_and_indices_are_misses_not_errors(tmp_path) -> None:
    storage, _ = stored(tmp_path)
    assert storage.batch_exists(["../../etc/passwd", HASHES[0]]) == 0
    assert storage.batch_exists([HASHES[0], "a/b"]) == 1
    assert storage.batch_get_v1(["", HASHES[1]], slots(DST[:2])) == [False, True]
    assert storage.batch_set_v1(["x" * 500], slots(DST[:1])) == [False]
    assert storage.batch_get_v1(HASHES, slots(DST[:2])) == [False] * 4  # too few slots
    assert storage.exists(HASHES[0]) and not storage.exists("..")
    storage.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"url": ""}, 'needs "url"'),
        ({"url": "file:///tmp/x", "io_timeout_s": 0}, "io_timeout_s"),
        ({"url": "file:///tmp/x", "io_timeout_s": "soon"}, "io_timeout_s"),
        ({"url": "nosuch://x"}, "cannot open nosuch://x"),
    ],
)
def test_bad_extra_config_is_a_config_error(extra, message) -> None:
    config = extra_config("unused")
    config.update(extra)
    with pytest.raises(ConfigError, match=message):
        create_storage(config, mha_pools("page_first")[1])


def test_unknown_extra_keys_are_named_in_a_warning(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        storage = create_storage(
            extra_config(f"file://{tmp_path}", io_timeuot_s=5), mha_pools("page_first")[1]
        )
    assert "io_timeuot_s" in caplog.text
    storage.close()


def test_stats_are_sglang_storage_metrics(tmp_path) -> None:
    storage, _ = stored(tmp_path)
    assert all(storage.batch_get_v1(HASHES, slots(DST)))
    metrics = storage.get_stats()
    assert isinstance(metrics, StorageMetrics)
    assert metrics.backup_pgs == [4] and metrics.prefetch_pgs == [4]
    assert all(bw > 0 for bw in metrics.prefetch_bandwidth + metrics.backup_bandwidth)
    assert storage.get_stats().prefetch_pgs == []  # drained
    storage.close()


def test_side_pools_with_hit_policies(tmp_path) -> None:
    storage, _ = stored(tmp_path)
    swa = mha_pools("page_first")[1]
    fill_random(swa, seed=21)
    storage.register_mem_host_pool_v2(swa, "swa")
    last_two = HASHES[2:]
    written = storage.batch_set_v2(
        [PoolTransfer(name="swa", host_indices=slots(SRC[2:]), keys=last_two)]
    )
    assert written == {"swa": [True, True]}
    trailing = PoolTransfer(name="swa", keys=last_two, hit_policy=PoolHitPolicy.TRAILING_PAGES)
    result = storage.batch_exists_v2(HASHES, [trailing])
    assert isinstance(result, PoolTransferResult)
    assert result.kv_hit_pages == 4 and result.extra_pool_hit_pages == {"kv": 4, "swa": 4}
    assert result.restorable_prefix_pages == [4]
    every = PoolTransfer(name="swa", keys=HASHES, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert storage.batch_exists_v2(HASHES, [every]).kv_hit_pages == 0
    target = mha_pools("page_first")[1]
    other = create_storage(extra_config(f"file://{tmp_path}"), mha_pools("page_first")[1])
    other.register_mem_host_pool_v2(target, "swa")
    read = other.batch_get_v2(
        [PoolTransfer(name="swa", host_indices=slots(DST[:2]), keys=last_two)]
    )
    assert read == {"swa": [True, True]}
    assert page_bytes(target, DST[0] * PAGE) == page_bytes(swa, SRC[2] * PAGE)
    unknown = storage.batch_get_v2(
        [PoolTransfer(name="mamba", host_indices=slots(DST[:1]), keys=HASHES[:1])]
    )
    assert unknown == {"mamba": [False]}
    storage.close()
    other.close()


def test_generic_and_flat_paths_agree_on_bf16_bytes(tmp_path) -> None:
    storage, source = stored(tmp_path)
    page = torch.zeros_like(source.get_dummy_flat_data_page())
    assert storage.get(HASHES[0], page) is page
    assert page.view(torch.uint8).numpy().tobytes() == page_bytes(source, SRC[0] * PAGE)
    storage.close()


def test_a_put_in_chunks_stores_every_page(tmp_path, monkeypatch) -> None:
    """Large batches are written in chunks whose checksums overlap the writes."""
    import hicache.integrations.sglang.page_io as sglang_io

    monkeypatch.setattr(sglang_io, "_MIN_PUT_CHUNK_BYTES", 1)  # every batch in 2 chunks
    pools = mha_pools("page_first")
    fill_random(pools[1], 1)
    storage = create_storage(extra_config(f"file://{tmp_path}"), pools[1])
    backend = storage.io.backend
    calls: list[int] = []
    original = backend.put_missing

    async def counted(keys, values):
        calls.append(len(keys))
        return await original(keys, values)

    monkeypatch.setattr(backend, "put_missing", counted)
    assert all(storage.batch_set_v1(HASHES, slots(SRC)))
    assert calls == [2, 2]
    other, target = reader(tmp_path)
    assert other.batch_get_v1(HASHES, slots(DST)) == [True] * 4
    assert same_pages(pools[1], target)
    storage.close()
    other.close()
