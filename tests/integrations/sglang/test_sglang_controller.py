"""A real HiCacheController with its storage threads over the adapter: backup and prefetch
acknowledged as SGLang's scheduler expects, attach and detach, and a failing backend contained."""

from __future__ import annotations

import queue

import pytest

pytest.importorskip(
    "sglang", reason="SGLang is installed only in the SGLang venv (make test-sglang)"
)

from sglang.srt.managers.cache_controller import get_storage_hash_str
from sglang_kit import PAGE, fill_random, mha_pools, one_rank, page_bytes
from test_sglang_pages import controller, zero_copy_controller

from hicache.errors import ConfigError
from hicache.integrations.sglang import extra_config

TOKENS = list(range(1000, 1000 + 6 * PAGE))
HASHES = get_storage_hash_str(TOKENS, None, page_size=PAGE)


def backup(ctl, pages_from: int = 2) -> object:
    """What the radix cache does on a write-through: host pages to storage, then the ack."""
    host_indices = ctl.mem_pool_host.alloc(len(TOKENS))
    assert host_indices is not None
    op_id = ctl.write_storage(host_indices, TOKENS, hash_value=HASHES)
    done = ctl.ack_backup_queue.get(timeout=30)
    assert done.id == op_id
    return done, host_indices


def prefetch(ctl, rid: str = "r1") -> tuple[list, object]:
    """A prefetch through the scheduler's steps: hit query, host allocation, transfer, acks."""
    operation = ctl.prefetch(rid, TOKENS)
    hit = ctl.prefetch_hit_queue.get(timeout=30)
    assert hit is operation
    acks = []
    if hit.storage_hit_count > 0:
        hit.host_indices = ctl.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
        ctl.prefetch_buffer.put(hit)
        while not (acks and acks[-1].completed_req):
            acks.append(ctl.ack_prefetch_queue.get(timeout=30))
    return acks, hit


def test_backup_is_acknowledged_with_every_token(tmp_path) -> None:
    with zero_copy_controller("page_first", 1, f"file://{tmp_path}") as (ctl, _):
        done, _ = backup(ctl)
        assert done.completed_tokens == len(TOKENS)
        assert ctl.storage_backend.batch_exists(HASHES) == len(HASHES)


@pytest.mark.parametrize("scheme", ["file", "disk", "redis"])
def test_prefetch_ends_in_completed_req_with_the_pages(tmp_path, request, scheme: str) -> None:
    url = request.getfixturevalue("redis_url") if scheme == "redis" else f"{scheme}://{tmp_path}"
    with zero_copy_controller("page_first", 2, url) as (writer, source):
        _, written = backup(writer)
    target = mha_pools("page_first")
    reader = controller(target, url, zero_copy=True)
    try:
        acks, operation = prefetch(reader)
        assert operation.storage_hit_count == len(TOKENS)
        assert acks[-1].completed_req and acks[-2].completed_tokens == len(TOKENS)
        for page in range(len(HASHES)):
            src = int(written[page * PAGE])
            dst = int(operation.host_indices[page * PAGE])
            assert page_bytes(target[1], dst) == page_bytes(source[1], src)
    finally:
        reader.detach_storage_backend()


def test_detach_closes_the_backend_and_attach_finds_the_pages(tmp_path) -> None:
    pools = mha_pools("layer_first")
    fill_random(pools[1], seed=4)
    ctl = controller(pools, f"file://{tmp_path}", zero_copy=True)
    storage = ctl.storage_backend
    backup(ctl)
    ctl.detach_storage_backend()
    assert storage.io.backend.closed and ctl.storage_backend is None
    assert storage.batch_exists(HASHES) == 0  # a closed adapter answers, it does not raise
    with one_rank():
        ctl.attach_storage_backend(
            "dynamic",
            model_name="org/tiny",
            storage_backend_extra_config=extra_config(f"file://{tmp_path}"),
        )
    try:
        assert ctl.storage_backend is not storage
        assert ctl.storage_backend.batch_exists(HASHES) == len(HASHES)
    finally:
        ctl.detach_storage_backend()


def test_an_attach_with_a_bad_url_fails_and_leaves_the_controller_usable(tmp_path) -> None:
    pools = mha_pools("page_first")
    ctl = controller(pools, f"file://{tmp_path}", zero_copy=True)
    ctl.detach_storage_backend()
    with one_rank():
        with pytest.raises(ConfigError, match="nosuchscheme"):
            ctl.attach_storage_backend(
                "dynamic",
                model_name="org/tiny",
                storage_backend_extra_config=extra_config("nosuchscheme://x"),
            )
        assert not ctl.enable_storage and ctl.storage_backend is None
        ctl.attach_storage_backend(
            "dynamic",
            model_name="org/tiny",
            storage_backend_extra_config=extra_config(f"file://{tmp_path}"),
        )
    ctl.detach_storage_backend()


def test_a_failing_backend_is_contained(tmp_path) -> None:
    """A backend that fails every call: backups report no tokens, prefetches find nothing, and
    SGLang's threads live on to serve the next operation."""
    with zero_copy_controller("page_first", 6, f"file://{tmp_path}") as (ctl, _):
        storage = ctl.storage_backend
        storage._loop.run(storage.io.backend.close())  # the store goes away under SGLang
        done, _ = backup(ctl)
        assert done.completed_tokens == 0
        acks, operation = prefetch(ctl, "r2")
        assert operation.storage_hit_count == 0 and acks == []
        assert ctl.backup_thread.is_alive() and ctl.prefetch_thread.is_alive()
        with pytest.raises(queue.Empty):
            ctl.ack_backup_queue.get_nowait()
