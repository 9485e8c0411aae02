"""The pools of each kind of model, defined once: one constructor per kind of pool, and the six
model presets built from them.

Every caller that needs a model's pools builds them here: :func:`preset` from a small
:class:`ModelShape` (tests, benchmarks, the public API) and the serving model's config
(:meth:`hicache.models.config.ModelConfig.pools`) from its own sizes. So a pool's name, layout,
hit rule and slot sharing are written in one place.

``replicated`` (``PoolSpec.replicated_across_tp``): a pool every tensor-parallel rank holds the
same bytes of (the MLA latent and what sits beside it) is stored once for all ranks. It is the
caller's choice: :func:`preset` describes a tensor-parallel deployment and marks them; the
serving engine runs one rank and stores every pool under that rank's shard.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache.dtypes import DType
from hicache.errors import InvalidArgumentError
from hicache.layouts import LayoutSpec
from hicache.pools.pool_spec import (
    INDEXER_SCALE_BYTES,
    STATE_AT_END,
    Granularity,
    HitRule,
    ModelPools,
    PoolSpec,
)

__all__ = [
    "DSV4_RATIOS",
    "ModelPreset",
    "ModelShape",
    "PoolPreset",
    "compressed_pool",
    "indexer_pool",
    "kv_pool",
    "latent_pool",
    "preset",
    "state_pools",
    "window_pool",
]

DSV4_RATIOS = (4, 128)  # tokens per compressed entry of the dsv4 pools: C4, C128


class ModelPreset(enum.Enum):
    """The kinds of model, by the state they cache."""

    DENSE = "dense"  # GQA attention in every layer: K and V per layer
    MLA = "mla"  # one latent per token per layer, K and V projected from it
    DSA = "dsa"  # MLA plus an indexer (fp8 key + fp32 scale per token) that picks the top-k pages
    SWA = "swa"  # sliding-window layers (window pages only) beside full-attention layers
    HYBRID = "hybrid"  # attention layers beside recurrent layers (conv and SSM state snapshots)
    DSV4 = "dsv4"  # DeepSeek-V4 style: 4:1 (indexed) and 128:1 compressed KV, an SWA window


PoolPreset = ModelPreset  # the pool API's name for the same enum (``hicache.PoolPreset``)


def kv_pool(
    layers: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: DType,
    replicated: bool = False,
) -> PoolSpec:
    """``kv``: K and V of every token of full-attention layers."""
    layout = LayoutSpec.mha(layers, kv_heads, head_dim, page_size, dtype)
    return PoolSpec("kv", layout, replicated_across_tp=replicated)


def window_pool(
    layers: int,
    kv_heads: int,
    head_dim: int,
    window: int,
    page_size: int,
    dtype: DType,
    replicated: bool = False,
) -> PoolSpec:
    """``swa``: K and V of sliding-window layers, whose prefix needs only the pages covering
    ``window`` tokens before its end."""
    layout = LayoutSpec.mha(layers, kv_heads, head_dim, page_size, dtype)
    rule = HitRule.window(window, page_size)
    return PoolSpec("swa", layout, rule, replicated_across_tp=replicated)


def latent_pool(
    layers: int, latent_dim: int, page_size: int, dtype: DType, replicated: bool = False
) -> PoolSpec:
    """``latent``: one MLA latent (kv_lora_rank + rope dim) per token per layer."""
    layout = LayoutSpec.mla(layers, latent_dim, page_size, dtype)
    return PoolSpec("latent", layout, replicated_across_tp=replicated)


def indexer_pool(
    layers: int,
    index_dim: int,
    page_size: int,
    owner: str,
    replicated: bool = False,
    ratio: int = 1,
) -> PoolSpec:
    """``indexer``: a DSA index key per entry, its fp8 bytes then an fp32 scale packed in one
    uint8 item (a page is one object, as SGLang stores it), on ``owner``'s slots. An entry of
    ``ratio`` tokens (dsv4's C4) is spread over its tokens' slots, ``1 / ratio`` per slot."""
    item = ((index_dim + INDEXER_SCALE_BYTES) // ratio,)
    layout = LayoutSpec(layers, page_size, item, DType.UINT8, ("index",))
    return PoolSpec("indexer", layout, replicated_across_tp=replicated, shares_slots_with=owner)


def compressed_pool(
    name: str,
    layers: int,
    dim: int,
    ratio: int,
    page_size: int,
    dtype: DType,
    owner: str | None = None,
    replicated: bool = False,
) -> PoolSpec:
    """A dsv4 compressed pool (``c4``, ``c128``): an entry of ``dim`` per ``ratio`` tokens,
    spread over its tokens' slots (``dim / ratio`` per slot), on ``owner``'s slots if given."""
    layout = LayoutSpec(layers, page_size, (dim // ratio,), dtype, (name,))
    return PoolSpec(name, layout, replicated_across_tp=replicated, shares_slots_with=owner)


def state_pools(
    layers: int,
    conv_item: tuple[int, ...],
    ssm_item: tuple[int, ...],
    conv_dtype: DType,
    ssm_dtype: DType,
) -> tuple[PoolSpec, PoolSpec]:
    """``conv`` and ``ssm`` (on ``conv``'s slots): recurrent layers' state, one snapshot a slot
    (layout page_size 1), kept where a prefix ends."""
    seq = Granularity.PER_SEQUENCE
    conv = LayoutSpec(layers, 1, conv_item, conv_dtype, ("conv",))
    ssm = LayoutSpec(layers, 1, ssm_item, ssm_dtype, ("ssm",))
    return (
        PoolSpec("conv", conv, STATE_AT_END, seq),
        PoolSpec("ssm", ssm, STATE_AT_END, seq, shares_slots_with="conv"),
    )


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
    return (kv_pool(s.layers, s.heads, s.head_dim, s.page_size, s.dtype),)


def _mla(s: ModelShape) -> tuple[PoolSpec, ...]:
    return (latent_pool(s.layers, s.latent_dim, s.page_size, s.dtype, replicated=True),)


def _dsa(s: ModelShape) -> tuple[PoolSpec, ...]:
    indexer = indexer_pool(s.layers, s.index_dim, s.page_size, "latent", replicated=True)
    return (*_mla(s), indexer)


def _swa(s: ModelShape) -> tuple[PoolSpec, ...]:
    window = window_pool(s.layers, s.heads, s.head_dim, s.window, s.page_size, s.dtype)
    if not s.full_layers:
        return (window,)
    return (kv_pool(s.full_layers, s.heads, s.head_dim, s.page_size, s.dtype), window)


def _hybrid(s: ModelShape) -> tuple[PoolSpec, ...]:
    states = state_pools(s.recurrent_layers, s.conv_shape, s.ssm_shape, s.dtype, s.state_dtype)
    return (*_dense(s), *states)


def _dsv4(s: ModelShape) -> tuple[PoolSpec, ...]:
    """Three lifecycles, as the seed's ShadowRadix gives DeepSeek-V4: ``c4`` (with the
    ``indexer`` that picks its top-k entries, on its slots), ``c128`` and ``swa`` each own their
    slots. A compressed entry is spread over the slots of its group's tokens (a quarter of a C4
    entry per token, 1/128 of a C128 entry), so a page of P tokens holds P/4 and P/128 entries
    and every pool's slots follow the tree's token positions; a group never straddles pages
    (the page size is a multiple of 128). Hit rules: ``c4``/``indexer`` and ``c128`` every page
    of a prefix (a query may pick any C4 entry, and attends to every C128 one), ``swa`` the
    pages of its window before the prefix end."""
    r4, r128 = DSV4_RATIOS
    if s.page_size % r128 or s.c4_dim % r4 or s.c128_dim % r128:
        raise InvalidArgumentError(
            f"dsv4 needs a page size that is a multiple of {r128} (got {s.page_size}), "
            f"c4_dim a multiple of {r4} and c128_dim of {r128}"
        )
    if s.window % s.page_size:
        raise InvalidArgumentError(f"window {s.window} must be a multiple of the page size")
    if (s.index_dim + INDEXER_SCALE_BYTES) % r4:
        raise InvalidArgumentError("dsv4: index_dim + 4 must be a multiple of 4")
    ps, dt, layers = s.page_size, s.dtype, s.layers
    return (
        compressed_pool("c4", layers, s.c4_dim, r4, ps, dt, replicated=True),
        indexer_pool(layers, s.index_dim, ps, "c4", replicated=True, ratio=r4),
        compressed_pool("c128", layers, s.c128_dim, r128, ps, dt, replicated=True),
        window_pool(layers, 1, s.head_dim, s.window, ps, dt, replicated=True),
    )


_BUILDERS = {
    ModelPreset.DENSE: _dense,
    ModelPreset.MLA: _mla,
    ModelPreset.DSA: _dsa,
    ModelPreset.SWA: _swa,
    ModelPreset.HYBRID: _hybrid,
    ModelPreset.DSV4: _dsv4,
}


def preset(name: ModelPreset, shape: ModelShape | None = None) -> ModelPools:
    """The pools of a ``name`` model of ``shape`` (default: tiny; for dsv4 the smallest page
    and window its 128:1 pool allows, 128 tokens)."""
    if not isinstance(name, ModelPreset):
        raise InvalidArgumentError(f"name must be a PoolPreset, got {name!r}")
    if shape is None and name is ModelPreset.DSV4:
        shape = ModelShape(page_size=DSV4_RATIOS[-1], window=DSV4_RATIOS[-1])
    shape = shape or ModelShape()
    if not isinstance(shape, ModelShape):
        raise InvalidArgumentError(f"shape must be a ModelShape, got {type(shape).__name__}")
    if shape.window < 1 or shape.full_layers < 0:
        raise InvalidArgumentError("window must be >= 1 and full_layers >= 0")
    return ModelPools(name.value, shape.page_size, _BUILDERS[name](shape))
