"""What a model caches: pool specs, hit rules, and presets for common attention families.

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

from hicache.dtypes import DType
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
    "ModelShape",
    "PoolPreset",
    "PoolSpec",
    "common_usable_prefix",
    "preset",
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


class PoolPreset(enum.Enum):
    DENSE = "dense"  # GQA: K and V per layer
    MLA = "mla"  # one latent per token per layer, the same on every TP rank
    DSA = "dsa"  # MLA plus the sparse-attention indexer (fp8 key + fp32 scale per token)
    SWA = "swa"  # sliding-window layers (window pages only) beside full-attention layers
    HYBRID = "hybrid"  # attention layers plus recurrent layers (conv and SSM state snapshots)
    DSV4 = "dsv4"  # DeepSeek-V4 style: 4:1 and 128:1 compressed KV, an indexer, an SWA window


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Sizes the presets are built from; the defaults are tiny, for tests and CPU serving.

    ``layers`` counts the attention layers of the preset's main pool: all of them for dense, MLA
    and DSA; the windowed ones for SWA (beside ``full_layers`` full-attention layers); the
    attention layers of a hybrid (beside ``recurrent_layers``).
    """

    layers: int = 2
    heads: int = 2  # KV heads per tensor-parallel rank
    head_dim: int = 16
    page_size: int = 4
    dtype: DType = DType.BFLOAT16
    latent_dim: int = 24  # MLA: kv_lora_rank + rope dim
    index_dim: int = 16  # DSA indexer key dim (fp8 bytes)
    window: int = 8  # SWA window, in tokens
    full_layers: int = 1  # SWA: full-attention layers beside the windowed ones (0: none)
    recurrent_layers: int = 2  # hybrid: Mamba / linear-attention layers
    conv_shape: tuple[int, ...] = (32, 3)  # hybrid: per layer, conv channels x (kernel - 1)
    ssm_shape: tuple[int, ...] = (2, 16, 8)  # hybrid: per layer, heads x head_dim x state dim
    state_dtype: DType = DType.FLOAT32  # hybrid: SSM states are kept in fp32
    c4_dim: int = 32  # dsv4: width of one 4:1 compressed entry (a multiple of 4)
    c128_dim: int = 128  # dsv4: width of one 128:1 compressed entry (a multiple of 128)


def _dense(s: ModelShape) -> tuple[PoolSpec, ...]:
    return (PoolSpec("kv", LayoutSpec.mha(s.layers, s.heads, s.head_dim, s.page_size, s.dtype)),)


def _mla(s: ModelShape) -> tuple[PoolSpec, ...]:
    latent = LayoutSpec.mla(s.layers, s.latent_dim, s.page_size, s.dtype)
    return (PoolSpec("latent", latent, replicated_across_tp=True),)


def _dsa(s: ModelShape) -> tuple[PoolSpec, ...]:
    # Key and scale packed as bytes in one item, so a page is one object (as SGLang stores it).
    item = (s.index_dim + INDEXER_SCALE_BYTES,)
    indexer = LayoutSpec(s.layers, s.page_size, item, DType.UINT8, ("index",))
    sidecar = PoolSpec("indexer", indexer, replicated_across_tp=True, shares_slots_with="latent")
    return (*_mla(s), sidecar)


def _swa(s: ModelShape) -> tuple[PoolSpec, ...]:
    window = LayoutSpec.mha(s.layers, s.heads, s.head_dim, s.page_size, s.dtype)
    pools = [PoolSpec("swa", window, HitRule.window(s.window, s.page_size))]
    if s.full_layers:
        full = LayoutSpec.mha(s.full_layers, s.heads, s.head_dim, s.page_size, s.dtype)
        pools.insert(0, PoolSpec("kv", full))
    return tuple(pools)


def _hybrid(s: ModelShape) -> tuple[PoolSpec, ...]:
    conv = LayoutSpec(s.recurrent_layers, 1, s.conv_shape, s.dtype, ("conv",))
    ssm = LayoutSpec(s.recurrent_layers, 1, s.ssm_shape, s.state_dtype, ("ssm",))
    seq = Granularity.PER_SEQUENCE
    return (
        *_dense(s),
        PoolSpec("conv", conv, STATE_AT_END, seq),
        PoolSpec("ssm", ssm, STATE_AT_END, seq, shares_slots_with="conv"),
    )


DSV4_RATIOS = (4, 128)  # tokens per compressed entry of the dsv4 pools


def _dsv4(s: ModelShape) -> tuple[PoolSpec, ...]:
    """A compressed entry is spread over the slots of its group's tokens (a quarter of a C4
    entry per token, 1/128 of a C128 entry), so a page of P tokens holds P/4 and P/128
    entries and the pools keep the tree's token slots; a group never straddles pages (the
    page size is a multiple of 128)."""
    if s.page_size % DSV4_RATIOS[-1] or s.c4_dim % 4 or s.c128_dim % 128:
        raise InvalidArgumentError(
            f"dsv4 needs a page size that is a multiple of {DSV4_RATIOS[-1]} (got {s.page_size}), "
            f"c4_dim a multiple of 4 and c128_dim of 128"
        )
    if s.window % s.page_size:
        raise InvalidArgumentError(f"window {s.window} must be a multiple of the page size")
    c4 = LayoutSpec(s.layers, s.page_size, (s.c4_dim // 4,), s.dtype, ("c4",))
    c128 = LayoutSpec(s.layers, s.page_size, (s.c128_dim // 128,), s.dtype, ("c128",))
    index_bytes = s.index_dim + INDEXER_SCALE_BYTES
    if index_bytes % 4:
        raise InvalidArgumentError("dsv4: index_dim + 4 must be a multiple of 4")
    indexer = LayoutSpec(s.layers, s.page_size, (index_bytes // 4,), DType.UINT8, ("index",))
    window = LayoutSpec.mha(s.layers, 1, s.head_dim, s.page_size, s.dtype)
    return (
        PoolSpec("c4", c4, replicated_across_tp=True),
        PoolSpec("indexer", indexer, replicated_across_tp=True, shares_slots_with="c4"),
        PoolSpec("c128", c128, replicated_across_tp=True, shares_slots_with="c4"),
        PoolSpec("swa", window, HitRule.window(s.window, s.page_size), replicated_across_tp=True),
    )


_BUILDERS = {
    PoolPreset.DENSE: _dense,
    PoolPreset.MLA: _mla,
    PoolPreset.DSA: _dsa,
    PoolPreset.SWA: _swa,
    PoolPreset.HYBRID: _hybrid,
    PoolPreset.DSV4: _dsv4,
}


def preset(name: PoolPreset, shape: ModelShape | None = None) -> ModelPools:
    """The pools of a ``name`` model of ``shape`` (default: tiny; for dsv4 the smallest page
    and window its 128:1 pool allows, 128 tokens)."""
    if not isinstance(name, PoolPreset):
        raise InvalidArgumentError(f"name must be a PoolPreset, got {name!r}")
    if shape is None and name is PoolPreset.DSV4:
        shape = ModelShape(page_size=DSV4_RATIOS[-1], window=DSV4_RATIOS[-1])
    shape = shape or ModelShape()
    if not isinstance(shape, ModelShape):
        raise InvalidArgumentError(f"shape must be a ModelShape, got {type(shape).__name__}")
    if shape.window < 1 or shape.full_layers < 0:
        raise InvalidArgumentError("window must be >= 1 and full_layers >= 0")
    return ModelPools(name.value, shape.page_size, _BUILDERS[name](shape))
