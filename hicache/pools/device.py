"""Device pools: one ``layer_first`` tensor per pool, on CUDA when there is one, else the CPU.

The tensor is the layouts' device buffer ``(C, L, S, *item)``: component, layer, slot, item, so
the layouts' gather/scatter move pages between it and a host pool. Attention reads and writes a
layer through :meth:`DevicePool.layer_views`; :meth:`DevicePool.write` and :meth:`DevicePool.read`
are the checked way in and out (tests, loading states, debugging). Slots come from a paged
:class:`~hicache.pools.allocator.TokenSlotAllocator`; a pool that ``shares_slots_with`` another
uses that pool's allocator and owns none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from hicache.errors import ConfigError, InvalidArgumentError, LayoutError
from hicache.layouts import Layout, buffer_shape
from hicache.pools._index import IndexLike, check_indices
from hicache.pools.pool_base import PoolBase, build_pool_group
from hicache.pools.pool_spec import INDEXER_SCALE_BYTES, ModelPools, PoolSpec

__all__ = [
    "DevicePool",
    "default_device",
    "device_pools",
    "indexer_as_float",
    "pack_indexer",
    "take_rows",
    "unpack_indexer",
]

logger = logging.getLogger(__name__)


# Writes and reads move bits through an integer view of the same width: exact for every dtype
# (NaN payloads included), and indexing kernels exist for integers where not for fp8.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def default_device() -> torch.device:
    """``cuda`` (the current CUDA device) when there is one, else ``cpu``."""
    return _resolve_device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return default_device()
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {resolved} asked for, but CUDA is not available")
    if resolved.type not in ("cuda", "cpu"):
        raise ConfigError(f"device pools live on cuda or cpu, not {resolved}")
    if resolved.type == "cuda" and resolved.index is None:  # equal to the tensors' device
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


class DevicePool(PoolBase):
    """The slots of one pool on the compute device.

    ``num_slots`` is in tokens for a per-token pool, in snapshots for a per-sequence pool, and
    a multiple of the spec's page size. ``owner`` is the pool named by ``spec.shares_slots_with``
    (and only then): both are addressed by the same slot indices, allocated through the owner.
    """

    _unit = "slot"

    def __init__(
        self,
        spec: PoolSpec,
        num_slots: int,
        device: torch.device | str | None = None,
        owner: DevicePool | None = None,
    ) -> None:
        if not isinstance(spec, PoolSpec):
            raise InvalidArgumentError(f"spec must be a PoolSpec, got {type(spec).__name__}")
        self.spec = spec
        self.device = _resolve_device(device)
        self.allocator = self._owned_or_shared_allocator(num_slots, owner, spec.page_size)
        self._offsets = torch.arange(spec.page_size, dtype=torch.int64)
        shape = buffer_shape(spec.layout, Layout.LAYER_FIRST, self.allocator.num_pages)
        # Zeros: a per-sequence state starts from the zero state, and a fresh KV slot is defined.
        self.buffer = torch.zeros(shape, dtype=spec.layout.dtype.to_torch(), device=self.device)
        self._bits = self.buffer.view(_BITS[self.buffer.element_size()])
        logger.debug("device pool %s: %s on %s", spec.name, list(shape), self.device)

    @property
    def size(self) -> int:
        return self.allocator.size

    def alloc(self, num_slots: int) -> torch.Tensor | None:
        """Slots for ``num_slots`` (whole pages), or None when they do not fit; all or nothing."""
        self._check_owner("allocate")
        return self.allocator.alloc(num_slots)

    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages; a page already free raises DoubleFreeError and frees nothing."""
        self._check_owner("free")
        # Repeats are left to the allocator, which names them a double free.
        index = check_indices(slots, self.size, "slot", distinct=False)
        ps = self.page_size
        if index.numel() % ps:
            raise InvalidArgumentError(f"free whole pages of {ps} slots, not {index.numel()}")
        rows = index.view(-1, ps)
        if bool((rows[:, 0] % ps != 0).any()) or bool((rows - rows[:, :1] != self._offsets).any()):
            raise InvalidArgumentError("free whole pages: each page's slots in order")
        self.allocator.free(index)

    def is_allocated(self, slots: IndexLike) -> torch.Tensor:
        """Per slot, whether it is allocated."""
        return self.allocator.is_allocated(check_indices(slots, self.size, "slot"))

    def layer_views(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Views ``(S, *item)`` of ``layer``, one per component (``k, v`` for K/V pools)."""
        self._check_layer(layer)
        return tuple(self.buffer[c, layer] for c in range(self.spec.layout.num_components))

    def component_view(self, name: str) -> torch.Tensor:
        """The ``(L, S, *item)`` view of one component, e.g. ``"k"``."""
        return self.buffer[self.spec.layout.component_index(name)]

    def write(self, slots: IndexLike, data: torch.Tensor, layer: int | None = None) -> None:
        """Copy ``data`` into ``slots``: shape ``(C, L, n, *item)``, or ``(C, n, *item)`` for one
        ``layer``; the pool's dtype exactly. Everything is checked before the copy."""
        index = self._checked(slots, layer)
        expect = self._shape(index.numel(), layer)
        if not isinstance(data, torch.Tensor):
            raise LayoutError(f"data must be a torch.Tensor, got {type(data).__name__}")
        if data.dtype != self.buffer.dtype:
            raise LayoutError(
                f"data has dtype {data.dtype}; pool {self.spec.name!r} holds {self.buffer.dtype}"
            )
        if tuple(data.shape) != expect:
            raise LayoutError(f"data has shape {list(data.shape)}; expected {list(expect)}")
        index = index.to(self.device)
        bits = data.view(self._bits.dtype).to(self.device)
        if layer is None:
            self._bits[:, :, index] = bits
        else:
            self._bits[:, layer, index] = bits

    def read(self, slots: IndexLike, layer: int | None = None) -> torch.Tensor:
        """A copy of ``slots``: ``(C, L, n, *item)``, or ``(C, n, *item)`` for one ``layer``."""
        index = self._checked(slots, layer).to(self.device)
        bits = self._bits[:, :, index] if layer is None else self._bits[:, layer, index]
        return bits.view(self.buffer.dtype)

    def _checked(self, slots: IndexLike, layer: int | None) -> torch.Tensor:
        if layer is not None:
            self._check_layer(layer)
        return check_indices(slots, self.size, "slot")

    def _check_layer(self, layer: int) -> None:
        layers = self.spec.layout.layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
            raise InvalidArgumentError(f"layer {layer!r} out of range [0, {layers})")

    def _shape(self, n: int, layer: int | None) -> tuple[int, ...]:
        layout = self.spec.layout
        lead = (
            (layout.num_components,)
            if layer is not None
            else (layout.num_components, layout.layers)
        )
        return (*lead, n, *layout.item_shape)

    def __repr__(self) -> str:
        return (
            f"DevicePool({self.spec.name!r}, slots={self.size}, used={self.used_size}, "
            f"device={self.device})"
        )


def device_pools(
    model: ModelPools, slots: Mapping[str, int], device: torch.device | str | None = None
) -> dict[str, DevicePool]:
    """A device pool per pool of ``model``; ``slots`` sizes each slot owner (sidecars follow)."""

    def make(spec: PoolSpec, size: int, owner: DevicePool | None) -> DevicePool:
        return DevicePool(spec, size, device if owner is None else owner.device, owner)

    return build_pool_group(model, slots, "slot", make)


def pack_indexer(keys: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """DSA indexer items as bytes: each token's fp8 key (``..., D``) then its fp32 scale."""
    if keys.dtype.itemsize != 1 or scales.dtype != torch.float32:
        raise LayoutError("indexer keys are 1-byte (fp8) values and scales float32")
    if tuple(scales.shape) != tuple(keys.shape[:-1]):
        raise LayoutError(
            f"scales shape {list(scales.shape)} must be keys shape {list(keys.shape)} less the "
            "last dimension"
        )
    scale_bytes = scales.contiguous().unsqueeze(-1).view(torch.uint8)
    return torch.cat([keys.contiguous().view(torch.uint8), scale_bytes], dim=-1)


def unpack_indexer(
    packed: torch.Tensor, key_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (keys, scales) that :func:`pack_indexer` packed."""
    if packed.dtype != torch.uint8 or packed.shape[-1] <= INDEXER_SCALE_BYTES:
        raise LayoutError("packed indexer items are uint8 with a key and a 4-byte scale")
    keys = packed[..., :-INDEXER_SCALE_BYTES].view(key_dtype)  # a view: 1-byte to 1-byte
    scales = packed[..., -INDEXER_SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)
    return keys, scales


def indexer_as_float(
    packed: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed indexer items as ``dtype`` (a float at least as wide as bfloat16's exponent)
    ``(keys / 256, scales * 256)``: each product is exactly
    the fp8 key times its scale (powers of two move exactly). The keys are decoded with integer
    ops through float16, four times faster on a CPU than torch's fp8 conversion: e4m3's
    exponent and mantissa are float16's shifted right by 7 bits, with a bias 8 smaller. An fp8
    NaN reads as 480: a quantized key is NaN only where its input was not finite, and then its
    scale (the input's absolute maximum) is not finite either."""
    keys, scales = unpack_indexer(packed)
    bits = keys.view(torch.int8).to(torch.int16)  # the sign extends into the high byte
    bits <<= 7
    bits &= _SIGN_EXPONENT_MANTISSA  # drops the extended sign's copies but the top bit
    return bits.view(torch.float16).to(dtype), scales.to(dtype) * 256.0


_SIGN_EXPONENT_MANTISSA = -16512  # 0xBF80 as int16: sign, four exponent bits, three mantissa


def take_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source[index]`` for an index of any shape, through ``index_select`` over the flattened
    index: on a CPU several times faster than advanced indexing with a 2-D index."""
    flat = source.index_select(0, index.reshape(-1))
    return flat.view(*index.shape, *source.shape[1:])
