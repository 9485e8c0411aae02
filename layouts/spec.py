"""What one KV pool stores per token: the ``LayoutSpec``, and presets for common model shapes."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from hicache.dtypes import DType
from hicache.errors import LayoutError

__all__ = ["KV_COMPONENTS", "LATENT_COMPONENTS", "LayoutSpec", "SpecPreset"]

KV_COMPONENTS = ("k", "v")
LATENT_COMPONENTS = ("latent",)


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """The shape of one pool's KV state, independent of how it is laid out in memory.

    Per layer and per token, each component (``k`` and ``v`` for MHA/GQA, one ``latent`` for MLA,
    one for an indexer cache) holds one *item* of ``item_shape`` elements of ``dtype``: ``(H, D)``
    for K or V, ``(1, dim)`` for an MLA latent. Every layer has the same item shape.
    """

    layers: int
    page_size: int
    item_shape: tuple[int, ...]
    dtype: DType = DType.BFLOAT16
    components: tuple[str, ...] = KV_COMPONENTS

    def __post_init__(self) -> None:
        _positive("layers", self.layers)
        _positive("page_size", self.page_size)
        if not isinstance(self.item_shape, tuple) or not self.item_shape:
            raise LayoutError(f"item_shape must be a non-empty tuple, got {self.item_shape!r}")
        for dim in self.item_shape:
            _positive("every item_shape dimension", dim)
        if not isinstance(self.dtype, DType):
            raise LayoutError(f"dtype must be a DType, got {self.dtype!r}")
        names = self.components
        if not isinstance(names, tuple) or not names or len(set(names)) != len(names):
            raise LayoutError(f"components must be distinct names, got {names!r}")

    @classmethod
    def mha(
        cls, layers: int, heads: int, head_dim: int, page_size: int, dtype: DType = DType.BFLOAT16
    ) -> LayoutSpec:
        """K and V of ``heads`` KV heads of ``head_dim`` per layer (MHA, GQA, MQA)."""
        return cls(layers, page_size, (heads, head_dim), dtype, KV_COMPONENTS)

    @classmethod
    def mla(
        cls, layers: int, dim: int, page_size: int, dtype: DType = DType.BFLOAT16
    ) -> LayoutSpec:
        """One compressed latent of ``dim`` (kv_lora_rank + rope dim) per layer (MLA)."""
        return cls(layers, page_size, (1, dim), dtype, LATENT_COMPONENTS)

    @property
    def num_components(self) -> int:
        return len(self.components)

    @property
    def item_elems(self) -> int:
        return math.prod(self.item_shape)

    @property
    def item_bytes(self) -> int:
        return self.item_elems * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over all layers and components."""
        return self.num_components * self.layers * self.item_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: what one stored object holds."""
        return self.page_size * self.token_bytes

    def component_index(self, name: str) -> int:
        try:
            return self.components.index(name)
        except ValueError:
            raise LayoutError(f"no component {name!r}; this spec has {self.components}") from None


class SpecPreset(enum.Enum):
    """Shapes of real models' pools (per tensor-parallel rank), for tests and benchmarks."""

    MHA = "mha"  # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16
    MHA_FP8 = "mha_fp8"  # the same with an fp8 e4m3 KV cache
    MLA = "mla"  # DeepSeek-V3: 61 layers, latent 512 + rope 64, bf16
    INDEXER = "indexer"  # DSA indexer: per token 128 fp8 key bytes + a 4-byte scale
    ODD = "odd"  # small odd sizes: catches any assumption about alignment or powers of two

    def spec(self, page_size: int, layers: int | None = None) -> LayoutSpec:
        """The preset at ``page_size``; ``layers`` overrides the layer count (small tests)."""
        full = _PRESET_SPECS[self]
        return LayoutSpec(
            layers if layers is not None else full.layers,
            page_size,
            full.item_shape,
            full.dtype,
            full.components,
        )


_PRESET_SPECS = {
    SpecPreset.MHA: LayoutSpec.mha(32, 8, 128, 1),
    SpecPreset.MHA_FP8: LayoutSpec.mha(32, 8, 128, 1, DType.FLOAT8_E4M3FN),
    SpecPreset.MLA: LayoutSpec.mla(61, 576, 1),
    SpecPreset.INDEXER: LayoutSpec(61, 1, (132,), DType.UINT8, ("index",)),
    SpecPreset.ODD: LayoutSpec(3, 1, (3, 5), DType.FLOAT16, ("a", "b", "c")),
}
