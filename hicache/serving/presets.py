"""The serving model's shape and the cache pools it needs, one preset per kind of cached state.

Every pool of a preset shares the anchor pool's slots (one slot per token), so a token page is
one bundle across pools that moves between tiers as a unit: the KV (or MLA latent), and beside
it the DSA indexer keys, the sliding-window layers' KV, or the recurrent layers' state after each
token. A hit therefore always has every pool's data for its pages; a page whose bundle is
incomplete in L3 is a miss. SWA layers attend to their window only, but their pages are kept
like any other (storing the window alone is an optimisation left for later).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache.dtypes import DType
from hicache.errors import ConfigError
from hicache.layouts.spec import LayoutSpec
from hicache.pools.pool_spec import ModelPools, PoolSpec

__all__ = ["MODEL_LIMITS", "SEED_MAX", "LayerKind", "ModelConfig", "ModelPreset"]

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
}
SEED_MAX = (1 << 32) - 1  # numpy's seeds are uint32


class ModelPreset(enum.Enum):
    DENSE = "dense"  # GQA attention in every layer
    MLA = "mla"  # one latent per token per layer, K and V projected from it
    DSA = "dsa"  # MLA plus an indexer that picks the top-k pages each query attends to
    SWA = "swa"  # sliding-window layers between full-attention layers
    HYBRID = "hybrid"  # attention layers between recurrent layers


class LayerKind(enum.Enum):
    ATTENTION = "attention"  # pool "kv"
    LATENT = "latent"  # pool "latent"
    SPARSE_LATENT = "sparse_latent"  # pools "latent" and "indexer"
    WINDOW = "window"  # pool "swa"
    RECURRENT = "recurrent"  # pool "state"


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
    window: int = 64  # SWA window in tokens
    state_dim: int = 16  # hybrid recurrent state width
    seed: int = 0
    kv_dtype: DType = DType.FLOAT32

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
            specs.append(PoolSpec("swa", layout, shares_slots_with=anchor))
        if count["state"]:
            layout = LayoutSpec(count["state"], ps, (self.state_dim,), DType.FLOAT32, ("state",))
            specs.append(PoolSpec("state", layout, shares_slots_with=anchor))
        return ModelPools(self.preset.value, ps, tuple(specs))


_POOLS = ("kv", "latent", "swa", "state")


def _pool_of(kind: LayerKind) -> str:
    return {
        LayerKind.ATTENTION: "kv",
        LayerKind.LATENT: "latent",
        LayerKind.SPARSE_LATENT: "latent",
        LayerKind.WINDOW: "swa",
        LayerKind.RECURRENT: "state",
    }[kind]


def pool_of(kind: LayerKind) -> str:
    return _pool_of(kind)
