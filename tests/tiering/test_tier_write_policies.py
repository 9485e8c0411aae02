"""Each write policy's exact device-to-host backup behaviour, and what eviction then does."""

from __future__ import annotations

import pytest
from tier_kit import PAGE, Harness

from hicache.keys import RadixKey
from hicache.tiering.common.config import TierConfig
from hicache.tiering.common.policies import WritePolicy

SYSTEM = list(range(1, 9))  # two pages shared by every request


def tokens(tail: int) -> list[int]:
    return SYSTEM + [100 + tail * 10 + i for i in range(PAGE)]


def backed_up(h: Harness) -> dict[tuple[int, ...], bool]:
    """Each node's first token ids -> whether it is on host."""
    out = {}
    for node in h.tree.all_nodes():
        first = tuple(memoryview(node.key).cast("I")[:2])
        out[first] = node.host_value is not None
    return out


async def build(policy: WritePolicy, **tiers: object) -> Harness:
    return await Harness.build(tiers=TierConfig(write_policy=policy, **tiers))  # type: ignore[arg-type]


async def test_write_through_backs_up_every_node_on_insert() -> None:
    async with await build(WritePolicy.WRITE_THROUGH) as h:
        h.run_request("a", tokens(0))
        await h.settle()
        assert all(backed_up(h).values()) and len(backed_up(h)) == 1
        h.run_request("b", tokens(1))
        await h.settle()
        assert backed_up(h) == {(1, 2): True, (100, 101): True, (110, 111): True}
        assert h.host["kv"].used_pages == 4  # 2 system + 1 + 1, no duplicate of the shared part


async def test_selective_backs_up_once_hits_reach_the_threshold() -> None:
    async with await build(WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold=2) as h:
        h.run_request("a", tokens(0))  # creates the node: no hit yet
        h.run_request("b", tokens(1))  # first reuse of SYSTEM: 1 hit
        await h.settle()
        assert not any(backed_up(h).values())
        h.run_request("c", tokens(2))  # second reuse: SYSTEM reaches 2 and is backed up
        await h.settle()
        state = backed_up(h)
        assert state[(1, 2)] is True
        assert [v for k, v in state.items() if k != (1, 2)] == [False, False, False]
        assert h.host["kv"].used_pages == 2


async def test_selective_internal_rematch_is_not_a_hit() -> None:
    async with await build(WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold=1) as h:
        h.run_request("a", tokens(0))
        node = h.tree.all_nodes()[0]
        assert node.hit_count == 0 and node.host_value is None
        h.tree.match_prefix(RadixKey(tokens(0)))
        assert node.hit_count == 1 and node.host_value is not None


async def test_write_back_copies_only_on_eviction_and_keeps_the_data() -> None:
    async with await build(WritePolicy.WRITE_BACK) as h:
        h.run_request("a", tokens(0))
        h.run_request("b", tokens(1))
        await h.settle()
        assert not any(backed_up(h).values())
        assert h.host["kv"].used_pages == 0
        freed = h.tree.evict(10_000)
        assert freed == 16
        assert all(backed_up(h).values()) and h.host["kv"].used_pages == 4
        assert h.kv.used_size == 0
        # everything comes back from host, bit-exact (run_request checks the KV it loads)
        sources = h.run_request("c", tokens(1))
        assert sources == {"device": 0, "host": 12, "computed": 0}


@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE])
async def test_device_eviction_keeps_backed_up_and_drops_the_rest(policy: WritePolicy) -> None:
    async with await build(policy, write_threshold=1) as h:
        h.run_request("a", tokens(0))
        h.run_request("b", tokens(1))  # SYSTEM hit once: selective backs it up, not the tails
        await h.settle()
        h.tree.evict(10_000)
        state = backed_up(h)
        if policy is WritePolicy.WRITE_THROUGH:
            assert state == {(1, 2): True, (100, 101): True, (110, 111): True}
        else:
            assert state == {(1, 2): True}  # the cold tails are gone, not on host
        assert h.kv.used_size == 0
        match = h.tree.match_prefix(RadixKey(tokens(1)))
        assert match.prefix_len == 0
        assert match.host_hit_length == (12 if policy is WritePolicy.WRITE_THROUGH else 8)


async def test_host_eviction_makes_room_for_new_backups() -> None:
    async with await Harness.build(host_pages=4) as h:  # room for the system prompt and two tails
        for i in range(6):
            h.run_request(f"r{i}", tokens(i))
            h.tree.evict(10_000)  # push everything down to host
            await h.settle()
        assert h.host["kv"].used_pages <= 4
        assert h.controller.metrics.counts["host_evicted_tokens"] > 0
        # whatever is left on host still loads back exactly (checked inside run_request)
        h.run_request("again", tokens(5))


async def test_host_eviction_drops_copies_that_are_on_device_and_in_l3(tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with await Harness.build(url=f"file://{tmp_path}", host_pages=8) as h:
        h.run_request("a", tokens(0))  # 3 pages on device, on host and (once written) in L3
        await h.settle()
        node = next(n for n in h.tree.all_nodes() if n.value is not None)
        assert node.in_storage and node.host_value is not None
        used = h.host["kv"].used_pages
        freed = h.tree.host_evictor.evict(used * PAGE)
        assert freed == used * PAGE and h.host["kv"].used_pages == 0
        assert all(n.value is not None and n.host_value is None for n in h.tree.all_nodes())
        # Still served from the device; evicting the device backs the pages up again.
        assert h.run_request("b", tokens(0))["device"] == 12
        h.tree.evict(10_000)
        assert h.run_request("c", tokens(0)) == {"device": 0, "host": 12, "computed": 0}
