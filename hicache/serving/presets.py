"""The serving model's shape and the cache pools it needs, one preset per kind of cached state.

Each kind of state has its own pool and lifecycle (the ShadowRadix idea): the anchor pool (the
full-attention KV, or the MLA latent) holds every token; the DSA indexer keys share the anchor's
slots (one bundle per token); the sliding-window layers' KV (``swa``) has slots of its own and
keeps only what a window needs (a request frees the pages that left its window, the tree keeps
the pages before a cached prefix's end that its window covers); the recurrent layers' state
(``conv``, with ``ssm`` on the same slots) is kept as snapshots taken every ``state_interval``
tokens and at request ends, not after every token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache.dtypes import DType
from hicache.errors import ConfigError
from hicache.layouts.spec import LayoutSpec
from hicache.pools.pool_spec import STATE_AT_END, Granularity, HitRule, ModelPools, PoolSpec

__all__ = [
    "MODEL_LIMITS",
    "SEED_MAX",
    "LayerKind",
    "ModelConfig",
    "ModelPreset",
    "check_whole_pages",
    "pools_of",
]

INDEXER_SCALE_BYTES = 4
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
}
SEED_MAX = (1 << 32) - 1  # numpy's seeds are uint32
# The command-line flag of the fields that must be whole pages (for errors a user can act on),
# and why they must.
_WHOLE_PAGES = {
    "window": ("--window", "the swa pool keeps whole pages of the window"),
    "state_interval": ("--state-interval", "state snapshots are taken at page ends"),
    "window_interval": ("--window-interval", "windows are kept at page ends"),
}


def check_whole_pages(name: str, value: int, page_size: int) -> None:
    """Raise ConfigError (naming the field and its flag) unless ``value`` is whole pages."""
    if value % page_size:
        flag, why = _WHOLE_PAGES[name]
        raise ConfigError(
            f"{flag} (model {name}) {value} must be a multiple of --page-size {page_size}: {why}"
        )


class ModelPreset(enum.Enum):
    DENSE = "dense"  # GQA attention in every layer
    MLA = "mla"  # one latent per token per layer, K and V projected from it
    DSA = "dsa"  # MLA plus an indexer that picks the top-k pages each query attends to
    SWA = "swa"  # sliding-window layers between full-attention layers
    HYBRID = "hybrid"  # attention layers between recurrent (Mamba-like) layers


class LayerKind(enum.Enum):
    ATTENTION = "attention"  # pool "kv"
    LATENT = "latent"  # pool "latent"
    SPARSE_LATENT = "sparse_latent"  # pools "latent" and "indexer"
    WINDOW = "window"  # pool "swa"
    RECURRENT = "recurrent"  # pools "conv" and "ssm"


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
    index_topk_pages: int = 4  # DSA: pages each query attends to (its own page included)
    window: int = 64  # SWA window in tokens (a multiple of page_size for the swa preset)
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

    def __post_init__(self) -> None:
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
        if self.preset in (ModelPreset.SWA, ModelPreset.HYBRID) and self.layers < 2:
            raise ConfigError(f"the {self.preset.value} preset needs at least 2 layers")
        if self.conv_kernel < 2:
            raise ConfigError(f"model conv_kernel must be at least 2, got {self.conv_kernel}")
        if self.preset is ModelPreset.SWA:  # checked where used: other presets ignore them
            check_whole_pages("window", self.window, self.page_size)
            check_whole_pages("window_interval", self.window_interval, self.page_size)
        if self.preset is ModelPreset.HYBRID:
            check_whole_pages("state_interval", self.state_interval, self.page_size)

    @property
    def keep_interval(self) -> int | None:
        """Tokens between the ends where the model's window or state pool keeps its data in
        the cache (None: every prefix is usable, as for dense, MLA and DSA)."""
        if self.preset is ModelPreset.SWA:
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
        mixed = LayerKind.WINDOW if self.preset is ModelPreset.SWA else LayerKind.RECURRENT
        return [LayerKind.ATTENTION if i % 2 == 0 else mixed for i in range(self.layers)]

    def pool_layer(self, index: int) -> int:
        """Layer ``index``'s layer number within its pool."""
        kinds = self.layer_kinds()
        return sum(1 for k in kinds[:index] if _pool_of(k) == _pool_of(kinds[index]))

    def pools(self) -> ModelPools:
        """The anchor pool first (``kv`` or ``latent``), then the others (see the module)."""
        kinds = self.layer_kinds()
        count = {name: sum(1 for k in kinds if _pool_of(k) == name) for name in _POOLS}
        ps, kv = self.page_size, self.kv_dtype
        specs: list[PoolSpec] = []
        if count["kv"]:
            specs.append(
                PoolSpec("kv", LayoutSpec.mha(count["kv"], self.kv_heads, self.head_dim, ps, kv))
            )
        if count["latent"]:
            specs.append(
                PoolSpec("latent", LayoutSpec.mla(count["latent"], self.latent_dim, ps, kv))
            )
        anchor = specs[0].name
        if self.preset is ModelPreset.DSA:
            item = (self.index_dim + INDEXER_SCALE_BYTES,)
            layout = LayoutSpec(count["latent"], ps, item, DType.UINT8, ("index",))
            specs.append(PoolSpec("indexer", layout, shares_slots_with=anchor))
        if count["swa"]:
            layout = LayoutSpec.mha(count["swa"], self.kv_heads, self.head_dim, ps, kv)
            specs.append(PoolSpec("swa", layout, HitRule.window(self.window, ps)))
        if count["conv"]:
            specs.extend(self._state_pools(count["conv"]))
        return ModelPools(self.preset.value, ps, tuple(specs))

    def _state_pools(self, layers: int) -> tuple[PoolSpec, PoolSpec]:
        """The recurrent layers' state: one snapshot a slot (layout page_size 1), float32."""
        seq, f32 = Granularity.PER_SEQUENCE, DType.FLOAT32
        conv = LayoutSpec(layers, 1, (self.conv_kernel - 1, self.state_inner), f32, ("conv",))
        ssm = LayoutSpec(layers, 1, (self.state_inner, self.state_dim), f32, ("ssm",))
        return (
            PoolSpec("conv", conv, STATE_AT_END, seq),
            PoolSpec("ssm", ssm, STATE_AT_END, seq, shares_slots_with="conv"),
        )


_POOLS = ("kv", "latent", "swa", "conv")


def _pool_of(kind: LayerKind) -> str:
    return {
        LayerKind.ATTENTION: "kv",
        LayerKind.LATENT: "latent",
        LayerKind.SPARSE_LATENT: "latent",
        LayerKind.WINDOW: "swa",
        LayerKind.RECURRENT: "conv",
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
    return (_pool_of(kind),)
