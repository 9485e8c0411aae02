"""The radix tree against a brute-force reference: a set of cached sequences per namespace.

Matches and inserts are predicted exactly from the reference. Which leaves an eviction frees
depends on the policy, so after each eviction the reference is re-read from the tree, and the
test checks instead that the tree only lost content (everything still cached was inserted
before), that it freed what it reported, and that locked prefixes are all still cached.
"""

from __future__ import annotations

import itertools
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hicache.errors import InvalidArgumentError
from hicache.keys import RadixKey
from hicache.radix import EvictionPolicy, RadixCache, RadixCacheConfig, TreeNode

Namespace = tuple[str | None, bool]  # (extra_key, is_bigram)
Seq = tuple[object, ...]  # units: token ids, or (t_i, t_i+1) pairs in bigram mode

NAMESPACES: list[Namespace] = [(None, False), ("a", False), ("b", False), ("a", True)]
# A tiny alphabet makes shared prefixes, splits inside nodes and divergence inside pages common.
TOKENS = st.lists(st.integers(0, 3), min_size=2, max_size=14)


def units(tokens: Sequence[int], bigram: bool) -> Seq:
    return tuple(itertools.pairwise(tokens)) if bigram else tuple(tokens)


def common_prefix(a: Seq, b: Seq) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def node_units(node: TreeNode, bigram: bool) -> Seq:
    """The units of a node's packed span (uint32 little-endian lanes, two per bigram unit)."""
    lanes = array("I")
    lanes.frombytes(node.key)
    if bigram:
        return tuple(zip(lanes[0::2], lanes[1::2]))
    return tuple(lanes)


def leaf_paths(root: TreeNode | None, bigram: bool) -> set[Seq]:
    """Every root-to-leaf sequence under a namespace root."""
    out: set[Seq] = set()
    stack: list[tuple[TreeNode, Seq]] = [(root, ())] if root is not None else []
    while stack:
        node, prefix = stack.pop()
        if not node.children and node.parent is not None:
            out.add(prefix)
        for child in node.children.values():
            stack.append((child, prefix + node_units(child, bigram)))
    return out


def maximal(seqs: Iterable[Seq]) -> set[Seq]:
    """The sequences that are not a proper prefix of another (what a tree's leaves spell)."""
    ordered = sorted(set(seqs), key=len, reverse=True)
    out: list[Seq] = []
    for s in ordered:
        if s and not any(t[: len(s)] == s for t in out):
            out.append(s)
    return set(out)


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.frozen_clock = False
        self.page = 1
        self.tree = RadixCache(RadixCacheConfig(simulated=True))
        self.ref: dict[Namespace, set[Seq]] = {ns: set() for ns in NAMESPACES}
        self.ever: dict[Namespace, set[Seq]] = {ns: set() for ns in NAMESPACES}
        self.locks: list[tuple[TreeNode, Namespace, list[int], int]] = []

    def clock(self) -> float:
        if not self.frozen_clock:  # a frozen clock leaves only the access tick to order by
            self.now += 1.0
        return self.now

    @initialize(
        page=st.sampled_from([1, 2, 4]),
        policy=st.sampled_from(list(EvictionPolicy)),
        frozen=st.booleans(),
    )
    def setup(self, page: int, policy: EvictionPolicy, frozen: bool) -> None:
        self.page, self.frozen_clock = page, frozen
        self.tree = RadixCache(RadixCacheConfig(page, policy, simulated=True), clock=self.clock)

    # ----- reference ------------------------------------------------------------------------
    def key(self, ns: Namespace, tokens: Sequence[int]) -> RadixKey:
        return RadixKey(list(tokens), ns[0], ns[1])

    def expected_match(self, ns: Namespace, seq: Seq) -> int:
        best = max((common_prefix(seq, s) for s in self.ref[ns]), default=0)
        return best - best % self.page

    def aligned(self, seq: Seq) -> Seq:
        return seq[: len(seq) - len(seq) % self.page]

    def remember(self, ns: Namespace, seq: Seq) -> None:
        if seq:
            self.ref[ns] = maximal(self.ref[ns] | {seq})
            self.ever[ns].add(seq)

    def resync_after_eviction(self, before: dict[Namespace, set[Seq]]) -> None:
        """Take the tree's content as the reference, checking it only lost content."""
        for ns in NAMESPACES:
            now = leaf_paths(self.tree.namespace_root(*ns), ns[1])
            for seq in now:
                assert any(s[: len(seq)] == seq for s in before[ns]), (ns, seq)
            self.ref[ns] = now

    # ----- rules ----------------------------------------------------------------------------
    @rule(ns=st.sampled_from(NAMESPACES), tokens=TOKENS, priority=st.integers(0, 3))
    def insert(self, ns: Namespace, tokens: list[int], priority: int) -> None:
        seq = self.aligned(units(tokens, ns[1]))
        expected = self.expected_match(ns, seq)
        assert self.tree.insert(self.key(ns, tokens), priority=priority) == expected
        self.remember(ns, seq)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=TOKENS)
    def match(self, ns: Namespace, tokens: list[int]) -> None:
        seq = units(tokens, ns[1])
        result = self.tree.match_prefix(self.key(ns, tokens))
        assert result.prefix_len == self.expected_match(ns, seq)
        spelled: Seq = ()
        for node in reversed(result.last_device_node.path_to_root()):
            assert node.namespace == ns  # the path never leaves the key's namespace
            spelled += node_units(node, ns[1])
        assert spelled == seq[: result.prefix_len]
        assert [n.id for n in result.path] == [
            n.id for n in reversed(result.last_device_node.path_to_root())
        ]

    @rule(ns=st.sampled_from(NAMESPACES), tokens=TOKENS)
    def lock(self, ns: Namespace, tokens: list[int]) -> None:
        result = self.tree.match_prefix(self.key(ns, tokens))
        self.tree.inc_lock_ref(result.last_device_node)
        self.locks.append((result.last_device_node, ns, tokens, result.prefix_len))

    @precondition(lambda self: bool(self.locks))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _, _, _ = self.locks.pop(i)
        self.tree.dec_lock_ref(node)

    @rule(data=st.data())
    def unlock_unlocked_raises(self, data: st.DataObject) -> None:
        free = [n for n in self.tree.all_nodes() if n.lock_ref == 0]
        if not free:
            return
        node = data.draw(st.sampled_from(free))
        sizes = (self.tree.evictable_size, self.tree.protected_size)
        locks = [n.lock_ref for n in node.path_to_root()]
        with pytest.raises(InvalidArgumentError):
            self.tree.dec_lock_ref(node)
        assert (self.tree.evictable_size, self.tree.protected_size) == sizes
        assert [n.lock_ref for n in node.path_to_root()] == locks

    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        before = {ns: set(seqs) for ns, seqs in self.ref.items()}
        size = self.tree.total_size
        freed = self.tree.evict(n)
        assert size - self.tree.total_size == freed
        assert freed >= n or self.tree.evictable_size == 0
        self.resync_after_eviction(before)

    @rule(
        ns=st.sampled_from(NAMESPACES),
        prompt=TOKENS,
        output=st.lists(st.integers(0, 3), max_size=6),
        capacity=st.integers(1, 40),
    )
    def request(self, ns: Namespace, prompt: list[int], output: list[int], capacity: int) -> None:
        """The replay step of ``hicache bench radix``: match, evict to capacity, insert."""
        full = self.aligned(units(prompt + output, ns[1]))
        result = self.tree.match_prefix(self.key(ns, prompt))
        hit = result.prefix_len
        assert hit == self.expected_match(ns, units(prompt, ns[1]))
        excess = self.tree.total_size + len(full) - hit - capacity
        freed = 0
        if excess > 0:
            before = {k: set(v) for k, v in self.ref.items()}
            self.tree.inc_lock_ref(result.last_device_node)
            freed = self.tree.evict(excess)
            assert freed >= excess or self.tree.evictable_size == 0
            assert self.tree.match_prefix(self.key(ns, prompt)).prefix_len == hit
            self.tree.dec_lock_ref(result.last_device_node)
            self.resync_after_eviction(before)
        self.tree.insert(self.key(ns, prompt + output))
        self.remember(ns, full)
        if freed >= excess:  # the locked prefix survived, so the insert added at most full - hit
            assert self.tree.total_size <= capacity

    # ----- invariants -----------------------------------------------------------------------
    @invariant()
    def sizes_are_exact(self) -> None:
        nodes = self.tree.all_nodes()
        locked = sum(n.length for n in nodes if n.lock_ref > 0)
        assert self.tree.protected_size == locked
        assert self.tree.evictable_size == sum(n.length for n in nodes if n.lock_ref == 0)
        assert self.tree.total_nodes == len(nodes)
        # Independent of node boundaries: the tree holds each distinct cached page prefix once.
        pages = {(ns, s[:k]) for ns in NAMESPACES for s in self.ref[ns]
                 for k in range(self.page, len(s) + 1, self.page)}  # fmt: skip
        assert self.tree.total_size == len(pages) * self.page

    @invariant()
    def structure_matches_reference(self) -> None:
        for ns in NAMESPACES:
            assert leaf_paths(self.tree.namespace_root(*ns), ns[1]) == self.ref[ns]
            assert all(any(e[: len(s)] == s for e in self.ever[ns]) for s in self.ref[ns])
        for node in self.tree.all_nodes():
            assert node.length > 0 and node.length % self.page == 0
            first_page = node.key[: len(node.key) // node.length * self.page]
            assert node.parent is not None and node.parent.children.get(first_page) is node

    @invariant()
    def locks_are_counted_and_kept(self) -> None:
        held: Counter[int] = Counter()
        for node, ns, tokens, prefix_len in self.locks:
            for n in node.path_to_root():
                held[n.id] += 1
            if prefix_len:  # the locked prefix is still cached, whole
                root = node.path_to_root()[-1].parent
                assert root is self.tree.namespace_root(*ns)
                assert self.expected_match(ns, units(tokens, ns[1])) >= prefix_len
        for n in self.tree.all_nodes():
            assert n.lock_ref == held[n.id], n


RadixMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.slow
class TestRadixTreeStateful(RadixMachine.TestCase):
    """The machine's runs, as one unittest case."""
