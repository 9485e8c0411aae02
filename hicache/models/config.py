"""The serving model's shape and the cache pools it needs, one preset per kind of cached state.

Each kind of state has its own pool and lifecycle (the ShadowRadix idea): the anchor pool (the
full-attention KV, or the MLA latent) holds every token; the DSA indexer keys share the anchor's
slots (one bundle per token); the sliding-window layers' KV (``swa``) has slots of its own and
keeps only what a window needs (a request frees the pages that left its window, the tree keeps
the pages before a cached prefix's end that its window covers); the recurrent layers' state
(``conv``, with ``ssm`` on the same slots) is kept as snapshots taken every ``state_interval``
tokens and at request ends, not after every token.

The ``dsv4`` preset (DeepSeek-V4-style hybrid attention) has no per-token KV of its own, and three
lifecycles, as the seed's ShadowRadix has: its anchor is ``c4``, the 4:1 compressed entries, each
spread over the slots of its group's 4 tokens (a quarter per token), with the indexer keys of
those entries (``indexer``) on the same slots; the 128:1 compressed entries (``c128``, 1/128 per
token) have slots of their own, and so has every layer's raw K/V in the ``swa`` window pool. Each
of the three allocates, evicts and backs up on its own; the tree's token positions are the one
axis they share. A group never straddles a page (the page size is a multiple of 128), so a page's
entries move with it.

``index_topk_pages`` defaults per preset (:func:`default_index_topk`): 4 pages for ``dsa``; for
``dsv4`` the seed's top-512 C4 entries scaled by the window: the seed's DeepSeek-V4 picks 512
entries (2048 tokens) beside a 128-token window, so the preset picks ``4 * window`` entries, 512
at its default window of 128. A context with fewer complete entries attends to all of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache.dtypes import DType
from hicache.errors import ConfigError
from hicache.pools.pool_spec import INDEXER_SCALE_BYTES, ModelPools, PoolSpec
from hicache.pools.presets import (
    DSV4_RATIOS,
    ModelPreset,
    compressed_pool,
    indexer_pool,
    kv_pool,
    latent_pool,
    state_pools,
    window_pool,
)

__all__ = [
    "DSV4_RATIOS",
    "MODEL_LIMITS",
    "SEED_MAX",
    "LayerKind",
    "ModelConfig",
    "ModelPreset",
    "check_dsv4_page_size",
    "check_whole_pages",
    "default_index_topk",
    "dsv4_defaults",
    "layer_group",
    "pool_of",
    "pools_of",
]

# Upper bounds of the sizes (each at least 1): far past any model this runs, and low enough that
# a typo is refused instead of allocating without end. What the sizes need together is checked
# against the machine's memory by whoever allocates (``hicache serve``).
MODEL_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 32,  # token ids are uint32
    "hidden": 1 << 16,
    "layers": 1024,
    "heads": 1024,
    "kv_heads": 1024,
    "head_dim": 4096,
    "page_size": 1 << 16,
    "latent_dim": 1 << 16,
    "index_dim": 4096,
    "index_topk_pages": 1 << 20,
    "window": 1 << 30,
    "state_dim": 1 << 16,
    "state_interval": 1 << 30,
    "window_interval": 1 << 30,
    "conv_kernel": 64,
    "state_inner": 1 << 16,
    "c4_dim": 1 << 16,
    "c128_dim": 1 << 20,
}
SEED_MAX = (1 << 32) - 1  # numpy's seeds are uint32
# The command-line flag of the fields that must be whole pages (for errors a user can act on),
# and why they must.
_WHOLE_PAGES = {
    "window": ("--window", "the swa pool keeps whole pages of the window"),
    "state_interval": ("--state-interval", "state snapshots are taken at page ends"),
    "window_interval": ("--window-interval", "windows are kept at page ends"),
}


def check_dsv4_page_size(page_size: int) -> None:
    """Raise ConfigError (naming ``--page-size``) unless a dsv4 page holds whole 128:1 groups."""
    group = DSV4_RATIOS[-1]
    if page_size % group:
        raise ConfigError(
            f"--page-size (model page_size) {page_size} must be a multiple of {group} for the "
            f"dsv4 preset: a {group}-token group never straddles a page"
        )


def dsv4_defaults(page_size: int, window_interval: int = 512) -> dict[str, int]:
    """The dsv4 window sizes where none are given: the smallest window its 128:1 groups allow
    (one page, at least 128 tokens) and ``window_interval`` rounded up to whole pages."""
    return {
        "window": max(DSV4_RATIOS[-1], page_size),
        "window_interval": -(-window_interval // page_size) * page_size,
    }


def check_whole_pages(name: str, value: int, page_size: int) -> None:
    """Raise ConfigError (naming the field and its flag) unless ``value`` is whole pages."""
    if value % page_size:
        flag, why = _WHOLE_PAGES[name]
        raise ConfigError(
            f"{flag} (model {name}) {value} must be a multiple of --page-size {page_size}: {why}"
        )


DSV4_TOPK_PER_WINDOW_TOKEN = 4  # the seed's top-512 C4 entries beside its 128-token window
DSA_TOPK_PAGES = 4  # DSA: pages each query attends to, where none are given


def default_index_topk(preset: ModelPreset, window: int) -> int:
    """``index_topk_pages`` where none is given: for ``dsv4`` the seed's 512 C4 entries per
    128-token window, scaled to ``window`` (``4 * window``, at most the model limit); else
    :data:`DSA_TOPK_PAGES`. A bad window is left to the window's own check."""
    if preset is ModelPreset.DSV4 and type(window) is int and window > 0:
        return min(DSV4_TOPK_PER_WINDOW_TOKEN * window, MODEL_LIMITS["index_topk_pages"])
    return DSA_TOPK_PAGES


class LayerKind(enum.Enum):
    ATTENTION = "attention"  # pool "kv"
    LATENT = "latent"  # pool "latent"
    SPARSE_LATENT = "sparse_latent"  # pools "latent" and "indexer"
    WINDOW = "window"  # pool "swa"
    RECURRENT = "recurrent"  # pools "conv" and "ssm"
    COMPRESSED_SPARSE = "compressed_sparse"  # dsv4 CSA: pools "c4", "indexer" and "swa"
    HEAVILY_COMPRESSED = "heavily_compressed"  # dsv4 HCA: pools "c128" and "swa"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only transformer; the defaults keep a CPU run short."""

    preset: ModelPreset = ModelPreset.DENSE
    vocab_size: int = 32000
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 16
    latent_dim: int = 32  # MLA
    index_dim: int = 16  # DSA indexer key width (fp8 bytes)
    # DSA: pages each query attends to (its own page included); dsv4: C4 entries per query.
    # 0: the preset's default (default_index_topk: dsa 4 pages, dsv4 4 * window entries)
    index_topk_pages: int = 0
    # SWA window in tokens (a multiple of page_size for the swa and dsv4 presets; dsv4: >= 128)
    window: int = 64
    state_dim: int = 16  # hybrid: the SSM state's width per channel (B and C projections)
    seed: int = 0
    kv_dtype: DType = DType.FLOAT32
    state_interval: int = 128  # hybrid: tokens between state snapshots (a multiple of page_size)
    conv_kernel: int = 4  # hybrid: the causal depthwise convolution's width (>= 2)
    state_inner: int = 64  # hybrid: channels of the recurrent layers (conv and SSM)
    # swa: tokens between the windows a request leaves in the tree (beside the ones at its
    # prompt's end and at each commit): a prefix that diverges from a cached one is usable up
    # to the last such window before it. A window costs ``window`` tokens of the swa pool.
    window_interval: int = 512
    c4_dim: int = 32  # dsv4: width of a 4:1 compressed entry (a multiple of 4)
    c128_dim: int = 128  # dsv4: width of a 128:1 compressed entry (a multiple of 128)
    # hybrid: layer i is attention iff i % attention_period == attention_offset, else recurrent
    attention_period: int = 2
    attention_offset: int = 0

    def __post_init__(self) -> None:
        if type(self.index_topk_pages) is int and self.index_topk_pages == 0:
            topk = default_index_topk(self.preset, self.window)
            object.__setattr__(self, "index_topk_pages", topk)  # frozen: resolved once, here
        for name, limit in MODEL_LIMITS.items():
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= limit:
                raise ConfigError(f"model {name} must be an int in [1, {limit}], got {value!r}")
        if type(self.seed) is not int or not 0 <= self.seed <= SEED_MAX:
            raise ConfigError(f"model seed must be an int in [0, {SEED_MAX}], got {self.seed!r}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even (rotary embedding pairs)")
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")
        if self.preset in (ModelPreset.SWA, ModelPreset.HYBRID, ModelPreset.DSV4) and (
            self.layers < 2
        ):
            raise ConfigError(f"the {self.preset.value} preset needs at least 2 layers")
        if self.conv_kernel < 2:
            raise ConfigError(f"model conv_kernel must be at least 2, got {self.conv_kernel}")
        if self.preset is ModelPreset.SWA:  # checked where used: other presets ignore them
            check_whole_pages("window", self.window, self.page_size)
            check_whole_pages("window_interval", self.window_interval, self.page_size)
        if self.preset is ModelPreset.HYBRID:
            check_whole_pages("state_interval", self.state_interval, self.page_size)
            self._check_layer_pattern()
        if self.preset is ModelPreset.DSA and self.latent_dim < 4:
            raise ConfigError(
                f"model latent_dim {self.latent_dim} must be at least 4 for the dsa preset: "
                "its last dims are the rotary key"
            )
        if self.preset is ModelPreset.DSV4:
            self._check_dsv4()

    def _check_layer_pattern(self) -> None:
        """The hybrid's attention pattern is well formed and gives layers of both kinds (the
        ``kv`` pool anchors the cache; the state pools need a recurrent layer)."""
        period, offset = self.attention_period, self.attention_offset
        limit = MODEL_LIMITS["layers"]
        if type(period) is not int or not 1 <= period <= limit:
            raise ConfigError(
                f"model attention_period must be an int in [1, {limit}], got {period!r}"
            )
        if type(offset) is not int or not 0 <= offset < period:
            raise ConfigError(
                f"model attention_offset must be an int in [0, {period - 1}], got {offset!r}"
            )
        kinds = set(self.layer_kinds())
        if kinds != {LayerKind.ATTENTION, LayerKind.RECURRENT}:
            raise ConfigError(
                f"the hybrid preset needs attention and recurrent layers: attention_period "
                f"{period} with attention_offset {offset} over {self.layers} layers gives "
                f"{sorted(k.value for k in kinds)} only"
            )

    def _check_dsv4(self) -> None:
        """A page holds whole 128:1 groups, the window covers one (its entry is compressed from
        the window pool's K/V), and each entry splits evenly over its group's token slots."""
        group = DSV4_RATIOS[-1]
        check_dsv4_page_size(self.page_size)
        if self.window < group:
            raise ConfigError(
                f"--window (model window) {self.window} must be at least {group} for the dsv4 "
                f"preset: a {group}-token group is compressed from the window pool"
            )
        check_whole_pages("window", self.window, self.page_size)
        check_whole_pages("window_interval", self.window_interval, self.page_size)
        splits = {
            "c4_dim": (self.c4_dim, DSV4_RATIOS[0]),
            "c128_dim": (self.c128_dim, group),
            "index_dim + 4": (self.index_dim + INDEXER_SCALE_BYTES, DSV4_RATIOS[0]),
        }
        for name, (value, ratio) in splits.items():
            if value % ratio:
                raise ConfigError(
                    f"model {name} ({value}) must be a multiple of {ratio} for the dsv4 preset: "
                    f"an entry is spread over the slots of its group's {ratio} tokens"
                )

    @property
    def keep_interval(self) -> int | None:
        """Tokens between the ends where the model's window or state pool keeps its data in
        the cache (None: every prefix is usable, as for dense, MLA and DSA)."""
        if self.preset in (ModelPreset.SWA, ModelPreset.DSV4):
            return self.window_interval
        if self.preset is ModelPreset.HYBRID:
            return self.state_interval
        return None

    def layer_kinds(self) -> list[LayerKind]:
        if self.preset is ModelPreset.DENSE:
            return [LayerKind.ATTENTION] * self.layers
        if self.preset is ModelPreset.MLA:
            return [LayerKind.LATENT] * self.layers
        if self.preset is ModelPreset.DSA:
            return [LayerKind.SPARSE_LATENT] * self.layers
        if self.preset is ModelPreset.DSV4:
            csa, hca = LayerKind.COMPRESSED_SPARSE, LayerKind.HEAVILY_COMPRESSED
            return [csa if i % 2 == 0 else hca for i in range(self.layers)]
        if self.preset is ModelPreset.HYBRID:
            period, offset = self.attention_period, self.attention_offset
            return [
                LayerKind.ATTENTION if i % period == offset else LayerKind.RECURRENT
                for i in range(self.layers)
            ]
        return [LayerKind.ATTENTION if i % 2 == 0 else LayerKind.WINDOW for i in range(self.layers)]

    def pool_layer(self, index: int) -> int:
        """Layer ``index``'s layer number within its pool."""
        kinds = self.layer_kinds()
        return sum(1 for k in kinds[:index] if _pool_of(k) == _pool_of(kinds[index]))

    def layer_pools(self, index: int) -> dict[str, int]:
        """Every pool layer ``index`` reads (:func:`pools_of`), with its layer number there."""
        kinds = self.layer_kinds()
        return {
            name: sum(1 for k in kinds[:index] if name in pools_of(k))
            for name in pools_of(kinds[index])
        }

    def pools(self) -> ModelPools:
        """The anchor pool first (``kv``, ``latent`` or ``c4``), then the others (see the
        module), built by :mod:`hicache.pools.presets`' constructors. None is marked
        replicated across tensor-parallel ranks: the engine serves one rank and stores every
        pool under its shard."""
        if self.preset is ModelPreset.DSV4:
            return ModelPools(self.preset.value, self.page_size, self._dsv4_pools())
        kinds = self.layer_kinds()
        count = {name: sum(1 for k in kinds if _pool_of(k) == name) for name in _POOLS}
        ps, kv = self.page_size, self.kv_dtype
        specs: list[PoolSpec] = []
        if count["kv"]:
            specs.append(kv_pool(count["kv"], self.kv_heads, self.head_dim, ps, kv))
        if count["latent"]:
            specs.append(latent_pool(count["latent"], self.latent_dim, ps, kv))
        if self.preset is ModelPreset.DSA:
            specs.append(indexer_pool(count["latent"], self.index_dim, ps, specs[0].name))
        if count["swa"]:
            heads, dim = self.kv_heads, self.head_dim
            specs.append(window_pool(count["swa"], heads, dim, self.window, ps, kv))
        if count["conv"]:
            conv, ssm = (self.conv_kernel - 1, self.state_inner), (self.state_inner, self.state_dim)
            specs.extend(state_pools(count["conv"], conv, ssm, DType.FLOAT32, DType.FLOAT32))
        return ModelPools(self.preset.value, ps, tuple(specs))

    def _dsv4_pools(self) -> tuple[PoolSpec, ...]:
        """``c4`` (the anchor: a quarter of a C4 entry per token slot, CSA layers) with
        ``indexer`` (a quarter of the entry's fp8 index key and fp32 scale, CSA layers) on its
        slots; ``c128`` (1/128 of a C128 entry, HCA layers) and ``swa`` (every layer's raw K/V,
        a window) on slots of their own."""
        kinds = self.layer_kinds()
        csa = sum(1 for k in kinds if k is LayerKind.COMPRESSED_SPARSE)
        hca = len(kinds) - csa
        ps, kv = self.page_size, self.kv_dtype
        r4, r128 = DSV4_RATIOS
        return (
            compressed_pool("c4", csa, self.c4_dim, r4, ps, kv),
            indexer_pool(csa, self.index_dim, ps, "c4", ratio=r4),
            compressed_pool("c128", hca, self.c128_dim, r128, ps, kv),
            window_pool(len(kinds), self.kv_heads, self.head_dim, self.window, ps, kv),
        )


_POOLS = ("kv", "latent", "swa", "conv")


def _pool_of(kind: LayerKind) -> str:
    return {
        LayerKind.ATTENTION: "kv",
        LayerKind.LATENT: "latent",
        LayerKind.SPARSE_LATENT: "latent",
        LayerKind.WINDOW: "swa",
        LayerKind.RECURRENT: "conv",
        LayerKind.COMPRESSED_SPARSE: "c4",
        LayerKind.HEAVILY_COMPRESSED: "c128",
    }[kind]


def pool_of(kind: LayerKind) -> str:
    """The pool that numbers a layer of ``kind`` (its slot owner)."""
    return _pool_of(kind)


def pools_of(kind: LayerKind) -> tuple[str, ...]:
    """Every pool a layer of ``kind`` reads (a forward waits on each before the layer)."""
    if kind is LayerKind.SPARSE_LATENT:
        return ("latent", "indexer")
    if kind is LayerKind.RECURRENT:
        return ("conv", "ssm")
    if kind is LayerKind.COMPRESSED_SPARSE:
        return ("c4", "indexer", "swa")
    if kind is LayerKind.HEAVILY_COMPRESSED:
        return ("c128", "swa")
    return (_pool_of(kind),)


def layer_group(kind: LayerKind) -> tuple[str, int] | None:
    """A dsv4 layer's compressed pool and the tokens per entry; None for other kinds."""
    if kind is LayerKind.COMPRESSED_SPARSE:
        return "c4", DSV4_RATIOS[0]
    if kind is LayerKind.HEAVILY_COMPRESSED:
        return "c128", DSV4_RATIOS[1]
    return None
