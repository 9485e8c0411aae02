"""What a model caches: pool specs and hit rules (the presets built from them:
:mod:`hicache.pools.presets`).

A :class:`PoolSpec` names one kind of cached state. Per-token pools (K/V, MLA latents, the DSA
indexer, SWA K/V) hold one item per token per layer, in pages of ``page_size`` tokens. Per-sequence
pools (Mamba / linear-attention conv and SSM states) hold one *snapshot* per slot: the state after
a whole number of token pages. Both are described by a :class:`~hicache.layouts.LayoutSpec`, so the
layouts' shapes, views and device<->host copies serve every pool alike; a per-sequence pool's
layout has ``page_size == 1`` (one snapshot is one page, one stored object). A state with parts of
different shapes or dtypes (Mamba's conv state and its fp32 SSM state) is two pools, the second
naming the first in ``shares_slots_with`` so one slot index addresses both.

The hit rule says which pages of a matched prefix a pool must hold for the prefix to be usable;
:func:`usable_ends` and :func:`usable_prefix` apply it, and :func:`common_usable_prefix` combines
the pools of one model. They are pure: the tree passes what each pool holds.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from hicache.errors import InvalidArgumentError, LayoutError
from hicache.layouts import LayoutSpec

__all__ = [
    "ALL_PAGES",
    "STATE_AT_END",
    "INDEXER_SCALE_BYTES",
    "Granularity",
    "HitRule",
    "HitRuleKind",
    "ModelPools",
    "PoolSpec",
    "common_usable_prefix",
    "usable_ends",
    "usable_prefix",
    "validate_pool_name",
]

# A pool name goes into page headers (1-16 ASCII bytes, NUL padded) and storage format digests;
# the key alphabet keeps it printable and free of NULs and path separators.
_POOL_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,15}\Z")

INDEXER_SCALE_BYTES = 4  # the fp32 scale that follows a token's fp8 indexer key


def validate_pool_name(name: object) -> str:
    """``name`` if it is 1-16 characters of ``[A-Za-z0-9._-]`` not starting with ``.`` or ``-``."""
    if not isinstance(name, str) or not _POOL_NAME_RE.match(name):
        raise InvalidArgumentError(
            f"a pool name is 1-16 characters of [A-Za-z0-9._-], not starting with '.' or '-'; "
            f"got {name!r}"
        )
    return name


class HitRuleKind(enum.Enum):
    ALL_PAGES = "all_pages"  # every page of the prefix: MHA/GQA K/V, MLA latent, DSA indexer
    TRAILING_PAGES = "trailing_pages"  # only the last ``pages`` pages: an SWA window
    STATE_AT_END = "state_at_end"  # a state snapshot at the prefix end: Mamba, linear attention


@dataclass(frozen=True, slots=True)
class HitRule:
    """Which pages of a matched prefix a pool must hold; ``pages`` is for TRAILING_PAGES only."""

    kind: HitRuleKind
    pages: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, HitRuleKind):
            raise InvalidArgumentError(f"kind must be a HitRuleKind, got {self.kind!r}")
        bad_int = isinstance(self.pages, bool) or not isinstance(self.pages, int)
        if self.kind is HitRuleKind.TRAILING_PAGES:
            if bad_int or self.pages < 1:
                raise InvalidArgumentError(f"TRAILING_PAGES needs pages >= 1, got {self.pages!r}")
        elif bad_int or self.pages != 0:
            raise InvalidArgumentError(f"{self.kind.name} takes no page count, got {self.pages!r}")

    @classmethod
    def trailing(cls, pages: int) -> HitRule:
        return cls(HitRuleKind.TRAILING_PAGES, pages)

    @classmethod
    def window(cls, window_tokens: int, page_size: int) -> HitRule:
        """The trailing pages that cover ``window_tokens`` tokens before the prefix end."""
        if window_tokens < 1 or page_size < 1:
            raise InvalidArgumentError("window_tokens and page_size must be positive")
        return cls.trailing(-(-window_tokens // page_size))


ALL_PAGES = HitRule(HitRuleKind.ALL_PAGES)
STATE_AT_END = HitRule(HitRuleKind.STATE_AT_END)


def usable_ends(rule: HitRule, present: Sequence[bool]) -> list[bool]:
    """For each prefix length ``n`` in ``0..len(present)`` pages, whether the pool can serve it.

    ``present[i]`` says what the pool holds for page ``i`` of the matched prefix: the page's data
    for per-token pools; for STATE_AT_END, a snapshot of the state after pages ``0..i``. The empty
    prefix is always usable (nothing to load, or the initial state).
    """
    if rule.kind is HitRuleKind.ALL_PAGES:  # every prefix up to the first absent page
        first_absent = _first_absent(present)
        return [True] * (first_absent + 1) + [False] * (len(present) - first_absent)
    ends = [True] * (len(present) + 1)
    run = 0  # consecutive present pages ending at page n - 1
    for n in range(1, len(present) + 1):
        held = bool(present[n - 1])
        run = run + 1 if held else 0
        if rule.kind is HitRuleKind.TRAILING_PAGES:
            ends[n] = run >= min(rule.pages, n)
        else:
            ends[n] = held
    return ends


def _first_absent(present: Sequence[bool]) -> int:
    """The index of the first false entry of ``present``, or its length (C loops, no Python
    one per page: a long cached prefix has hundreds)."""
    flags = list(map(bool, present))
    try:
        return flags.index(False)
    except ValueError:
        return len(flags)


def _longest(ends: list[bool]) -> int:
    """The last usable prefix length of ``ends`` (the empty prefix always is)."""
    return len(ends) - 1 - ends[::-1].index(True)


def usable_prefix(rule: HitRule, present: Sequence[bool]) -> int:
    """The longest prefix, in pages, that the pool can serve (see :func:`usable_ends`)."""
    return _longest(usable_ends(rule, present))


def common_usable_prefix(pools: Iterable[tuple[HitRule, Sequence[bool]]]) -> int:
    """The longest prefix every pool can serve at once, in pages.

    Not the minimum of each pool's own best: an SWA window or a state snapshot may exist at a
    shorter length only, so the answer is the largest length usable by all of them.
    """
    common: list[bool] | None = None
    for rule, present in pools:
        ends = usable_ends(rule, present)
        if common is None:
            common = ends
            continue
        if len(ends) != len(common):
            raise InvalidArgumentError("every pool must report the same number of pages")
        common = [a and b for a, b in zip(common, ends)]
    if common is None:
        raise InvalidArgumentError("no pools given")
    return _longest(common)


class Granularity(enum.Enum):
    PER_TOKEN = "per_token"  # one item per token per layer, pages of page_size tokens
    PER_SEQUENCE = "per_sequence"  # one state snapshot per slot, taken at a page boundary


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One kind of cached state of a model.

    ``replicated_across_tp``: every tensor-parallel rank holds the same bytes (MLA), so the pool
    is stored once, not once per rank. ``shares_slots_with``: this pool has no allocator of its
    own and is addressed by the named pool's slot indices (the DSA indexer beside the latent, the
    SSM state beside the conv state).
    """

    name: str
    layout: LayoutSpec
    hit_rule: HitRule = ALL_PAGES
    granularity: Granularity = Granularity.PER_TOKEN
    replicated_across_tp: bool = False
    shares_slots_with: str | None = None

    def __post_init__(self) -> None:
        validate_pool_name(self.name)
        if not isinstance(self.layout, LayoutSpec):
            raise LayoutError(f"layout must be a LayoutSpec, got {type(self.layout).__name__}")
        if not isinstance(self.hit_rule, HitRule) or not isinstance(self.granularity, Granularity):
            raise InvalidArgumentError("hit_rule must be a HitRule and granularity a Granularity")
        per_sequence = self.granularity is Granularity.PER_SEQUENCE
        if per_sequence != (self.hit_rule.kind is HitRuleKind.STATE_AT_END):
            raise InvalidArgumentError(
                f"pool {self.name!r}: STATE_AT_END is the rule of per-sequence pools, "
                "and theirs only"
            )
        if per_sequence and self.layout.page_size != 1:
            raise LayoutError(
                f"pool {self.name!r}: a per-sequence pool holds one snapshot per page "
                f"(layout page_size 1), got {self.layout.page_size}"
            )
        shared = self.shares_slots_with
        if shared is not None and validate_pool_name(shared) == self.name:
            raise InvalidArgumentError(f"pool {self.name!r} cannot share slots with itself")

    @property
    def page_size(self) -> int:
        """Slots per page: tokens for a per-token pool, 1 snapshot for a per-sequence pool."""
        return self.layout.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (one stored object) on one rank."""
        return self.layout.page_bytes


@dataclass(frozen=True, slots=True)
class ModelPools:
    """The pools of one model: what the tree indexes, page by page of ``page_size`` tokens."""

    name: str
    page_size: int
    pools: tuple[PoolSpec, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.pools, tuple) or not self.pools:
            raise InvalidArgumentError("a model needs a non-empty tuple of pools")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"pool names must be distinct, got {names}")
        for spec in self.pools:
            if spec.granularity is Granularity.PER_TOKEN and spec.page_size != self.page_size:
                raise InvalidArgumentError(
                    f"pool {spec.name!r} has page_size {spec.page_size}; the model's is "
                    f"{self.page_size}"
                )
            self._check_sharing(spec)

    def _check_sharing(self, spec: PoolSpec) -> None:
        if spec.shares_slots_with is None:
            return
        owner = self.pool(spec.shares_slots_with)
        if owner.shares_slots_with is not None:
            raise InvalidArgumentError(
                f"pool {spec.name!r} shares slots with {owner.name!r}, which itself shares: "
                "name the pool that owns the slots"
            )
        if (owner.granularity, owner.page_size) != (spec.granularity, spec.page_size):
            raise InvalidArgumentError(
                f"pool {spec.name!r} and its slot owner {owner.name!r} differ in granularity "
                "or page size"
            )

    def __iter__(self) -> Iterator[PoolSpec]:
        return iter(self.pools)

    def __len__(self) -> int:
        return len(self.pools)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pools)

    def pool(self, name: str) -> PoolSpec:
        for spec in self.pools:
            if spec.name == name:
                return spec
        raise InvalidArgumentError(f"no pool {name!r}; this model has {self.names}")

    def sidecars(self, owner: str) -> tuple[PoolSpec, ...]:
        """The pools addressed by ``owner``'s slots."""
        return tuple(p for p in self.pools if p.shares_slots_with == owner)

    @property
    def hit_rules(self) -> dict[str, HitRule]:
        return {p.name: p.hit_rule for p in self.pools}
