"""The tiered tree over several pools, driven by random steps: after every step each pool's
device and host allocators hold exactly what the tree's nodes hold, and every hit, from
whichever tier, holds the data its tokens were cached with (``PoolKit.fetch`` checks it)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from pool_kit import PoolKit
from tier_kit import PAGE

from hicache.keys import RadixKey
from hicache.pools.presets import PoolPreset
from hicache.radix.node import TreeNode
from hicache.tiering.common.config import TierConfig
from hicache.tiering.common.policies import WritePolicy

# Few distinct tokens: shared prefixes and splits inside nodes are common.
SEQS = st.lists(st.integers(1, 3), min_size=1, max_size=8).map(
    lambda pages: [t for i, p in enumerate(pages) for t in [p, i, p, 0][:PAGE]]
)
POOLS = st.sampled_from(["swa", "conv"])


def _machine(kind: PoolPreset, policy: WritePolicy, l3: bool) -> type[RuleBasedStateMachine]:
    class TieredPools(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.kit = self.loop.run_until_complete(
                PoolKit.build(
                    kind,
                    sizes={"kv": 48, "swa": 16, "conv": 4},
                    host_sizes={"kv": 20, "swa": 8, "conv": 5},
                    tiers=TierConfig(write_policy=policy, write_threshold=2),
                    url="memory://" if l3 else None,
                )
            )

            self.cached: list[list[int]] = []
            self.held: list[tuple[list[int], TreeNode]] = []  # prefixes a "request" locks

        def teardown(self) -> None:
            self.loop.run_until_complete(self.kit.close())
            self.loop.close()

        @rule(tokens=SEQS, cut=st.integers(1, 7))
        def cache(self, tokens: list[int], cut: int) -> None:
            snapshots = (cut * PAGE,) if cut * PAGE < len(tokens) else ()
            if self.kit.cache(tokens, snapshots if kind is PoolPreset.HYBRID else ()):
                self.cached.append(tokens)

        @rule(
            which=st.integers(0, 1 << 16),
            keep=st.integers(1, 8),
            tail=st.one_of(st.just([]), SEQS),
        )
        def fetch(self, which: int, keep: int, tail: list[int]) -> None:
            """A request sharing a page-aligned prefix of something cached before."""
            base = self.cached[which % len(self.cached)] if self.cached else []
            tokens = base[: keep * PAGE] + tail
            if not tokens:
                return
            device, host = self.kit.fetch(tokens)
            assert device + host <= len(tokens)

        @rule(
            which=st.integers(0, 1 << 16),
            keep=st.integers(1, 8),
            tail=st.one_of(st.just([]), SEQS),
        )
        def prefetch(self, which: int, keep: int, tail: list[int]) -> None:
            """Read from L3 what device and host lack (after every write landed), then fetch."""
            tree = self.kit.tree
            base = self.cached[which % len(self.cached)] if self.cached else []
            tokens = base[: keep * PAGE] + tail
            if not tokens or not tree.storage.enabled:
                return

            async def read() -> None:
                await tree.quiesce(10)
                match = tree.match_prefix(RadixKey(tokens), count_hits=False)
                tree.prefetcher.start("r", RadixKey(tokens), match)
                await tree.quiesce(10)

            self.loop.run_until_complete(read())
            self.kit.fetch(tokens)

        @rule(which=st.integers(0, 1 << 16))
        def hold(self, which: int) -> None:
            """Lock a cached prefix as a running request does: the tree lock and every pool's."""
            if not self.cached:
                return
            tokens = self.cached[which % len(self.cached)]
            tree = self.kit.tree
            match = tree.match_prefix(RadixKey(tokens), count_hits=False)
            if not match.prefix_len:
                return
            node = match.last_device_node
            tree.inc_lock_ref(node)
            for pool in tree.roles.extra:
                tree.ledger.lock(node, pool)
            self.held.append((tokens[: match.prefix_len], node))

        @rule(which=st.integers(0, 1 << 16))
        def release(self, which: int) -> None:
            if not self.held:
                return
            _, node = self.held.pop(which % len(self.held))
            tree = self.kit.tree
            for pool in tree.roles.extra:
                tree.ledger.unlock(node, pool)
            tree.dec_lock_ref(node)

        @rule(where=st.sampled_from(["device", "host"]), pool=POOLS, amount=st.integers(1, 64))
        def evict(self, where: str, pool: str, amount: int) -> None:
            """Device or host eviction, of the whole tree or of one extra pool."""
            tree = self.kit.tree
            extra = pool if pool in tree.roles.extra and amount % 2 else None
            if where == "device":
                tree.evict_pool(extra, amount) if extra else tree.evict(amount)
            else:
                tree.host_evictor.evict(amount, extra)

        @invariant()
        def allocators_match_the_tree(self) -> None:
            self.kit.tree.check_events()
            self.kit.recount()

        @invariant()
        def locked_prefixes_stay_on_the_device(self) -> None:
            tree = self.kit.tree
            for tokens, _ in self.held:
                match = tree.match_prefix(RadixKey(tokens), count_hits=False)
                assert match.prefix_len == len(tokens), "a locked prefix lost a pool's data"
                self.kit.check(tokens, match.device_indices, match.pool_indices)

    return TieredPools


@pytest.mark.parametrize("kind", [PoolPreset.SWA, PoolPreset.HYBRID])
@pytest.mark.parametrize(
    ("policy", "l3"),
    [(policy, False) for policy in WritePolicy] + [(WritePolicy.WRITE_THROUGH, True)],
)
def test_tiered_pools_state_machine(kind: PoolPreset, policy: WritePolicy, l3: bool) -> None:
    run_state_machine_as_test(
        _machine(kind, policy, l3),
        settings=settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
