"""Device pools: every preset's pools, checked writes and reads, allocation, sidecar pools."""

from __future__ import annotations

import pytest
import torch
from cuda_kit import needs_cuda
from pool_bytes_kit import as_bytes, random_like

from hicache.dtypes import DType
from hicache.errors import ConfigError, DoubleFreeError, InvalidArgumentError, LayoutError
from hicache.layouts import LayoutSpec
from hicache.pools import (
    DevicePool,
    ModelPools,
    PoolPreset,
    PoolSpec,
    default_device,
    device_pools,
    pack_indexer,
    preset,
    unpack_indexer,
)
from hicache.pools.device import indexer_as_float, take_rows

PRESETS = list(PoolPreset)


def pools_of(model: ModelPools, pages: int = 4, device: str = "cpu") -> dict[str, DevicePool]:
    slots = {p.name: pages * p.page_size for p in model if p.shares_slots_with is None}
    return device_pools(model, slots, device)


def data_for(pool: DevicePool, n: int, seed: int, layer: int | None = None) -> torch.Tensor:
    layout = pool.spec.layout
    lead = (layout.num_components,) if layer is not None else (layout.num_components, layout.layers)
    return random_like((*lead, n, *layout.item_shape), pool.buffer.dtype, seed)


def owner_of(pools: dict[str, DevicePool], pool: DevicePool) -> DevicePool:
    return pools[pool.spec.shares_slots_with or pool.spec.name]


@pytest.mark.parametrize("name", PRESETS)
def test_write_then_read_is_exact_for_every_pool(name: PoolPreset) -> None:
    pools = pools_of(preset(name))
    for seed, pool in enumerate(pools.values()):
        assert pool.device == torch.device("cpu")
        owner = owner_of(pools, pool)
        slots = owner.alloc(2 * pool.page_size) if pool.owns_slots else owner.alloc(pool.page_size)
        assert slots is not None
        data = data_for(pool, slots.numel(), seed)
        pool.write(slots, data)
        assert torch.equal(as_bytes(pool.read(slots)), as_bytes(data))
        one = data_for(pool, slots.numel(), seed + 100, layer=0)
        pool.write(slots.tolist(), one, layer=0)
        assert torch.equal(as_bytes(pool.read(slots, layer=0)), as_bytes(one))
        assert torch.equal(as_bytes(pool.layer_views(0)[0][slots]), as_bytes(one[0]))


def test_layer_views_are_views_of_the_pool() -> None:
    (spec,) = preset(PoolPreset.DENSE).pools
    pool = DevicePool(spec, 16, "cpu")
    k, v = pool.layer_views(1)
    assert k.shape == (16, *spec.layout.item_shape)
    k[3] = 1.0
    v[3] = 2.0
    got = pool.read([3], layer=1)
    assert bool((got[0] == 1).all()) and bool((got[1] == 2).all())
    assert bool((pool.read([3], layer=0) == 0).all())
    assert pool.component_view("v")[1, 3].eq(2).all()
    with pytest.raises(InvalidArgumentError):
        pool.layer_views(2)
    with pytest.raises(LayoutError):
        pool.component_view("latent")


def test_alloc_beyond_capacity_is_none_and_changes_nothing() -> None:
    (spec,) = preset(PoolPreset.DENSE).pools  # page_size 4
    pool = DevicePool(spec, 16, "cpu")
    first = pool.alloc(8)
    assert first is not None and pool.available_size == 8 and pool.used_size == 8
    assert pool.alloc(12) is None
    assert pool.available_size == 8
    with pytest.raises(InvalidArgumentError):
        pool.alloc(3)  # not whole pages
    assert pool.is_allocated(first).all() and not pool.is_allocated([8, 12]).any()


def test_double_free_is_typed_and_frees_nothing() -> None:
    (spec,) = preset(PoolPreset.DENSE).pools
    pool = DevicePool(spec, 16, "cpu")
    a, b = pool.alloc(4), pool.alloc(4)
    assert a is not None and b is not None
    pool.free(a)
    with pytest.raises(DoubleFreeError):
        pool.free(torch.cat([b, a]))  # b is allocated, a is not: neither may be freed
    assert pool.is_allocated(b).all() and pool.available_size == 12
    with pytest.raises(DoubleFreeError):
        pool.free(torch.cat([b, b]))
    assert pool.is_allocated(b).all()
    for bad in ([0, 1, 2], [1, 2, 3, 4], [4, 6, 5, 7], [16, 17, 18, 19], [-4, -3, -2, -1]):
        with pytest.raises(InvalidArgumentError):
            pool.free(torch.tensor(bad))
    assert pool.available_size == 12
    pool.free(b)
    assert pool.available_size == 16


def test_bad_writes_are_typed_and_change_nothing() -> None:
    (spec,) = preset(PoolPreset.DENSE).pools
    pool = DevicePool(spec, 16, "cpu")
    slots = pool.alloc(4)
    assert slots is not None
    pool.write(slots, data_for(pool, 4, 1))
    before = pool.buffer.clone()
    good = data_for(pool, 4, 2)
    cases: list[tuple[object, object, type[Exception]]] = [
        (slots, good.float(), LayoutError),  # dtype
        (slots, good[:, :, :3], LayoutError),  # shape
        (slots, as_bytes(good).numpy().tobytes(), LayoutError),  # not a tensor
        ([0, 1, 2, 16], good, InvalidArgumentError),  # out of range
        ([0, 1, 1, 2], good, InvalidArgumentError),  # repeated
        ([0.0, 1.0, 2.0, 3.0], good, InvalidArgumentError),  # not integers
        (torch.tensor([True, False, True, False]), good, InvalidArgumentError),
    ]
    for bad_slots, data, error in cases:
        with pytest.raises(error):
            pool.write(bad_slots, data)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        pool.write(slots, good[:, 0], layer=5)
    with pytest.raises(InvalidArgumentError):
        pool.read([16])
    assert torch.equal(as_bytes(pool.buffer), as_bytes(before))


def test_sidecar_pool_uses_its_owners_slots() -> None:
    model = preset(PoolPreset.DSA)
    pools = device_pools(model, {"latent": 16}, "cpu")
    latent, indexer = pools["latent"], pools["indexer"]
    assert indexer.allocator is latent.allocator and indexer.size == 16
    slots = latent.alloc(4)
    assert slots is not None
    assert indexer.is_allocated(slots).all() and indexer.available_size == 12
    with pytest.raises(InvalidArgumentError):
        indexer.alloc(4)
    with pytest.raises(InvalidArgumentError):
        indexer.free(slots)
    assert indexer.available_size == 12
    latent.free(slots)
    assert indexer.available_size == 16


def test_sidecar_and_owner_wiring_errors() -> None:
    model = preset(PoolPreset.DSA)
    latent_spec, indexer_spec = model.pools
    latent = DevicePool(latent_spec, 16, "cpu")
    with pytest.raises(InvalidArgumentError):
        DevicePool(indexer_spec, 16, "cpu")  # no owner
    with pytest.raises(InvalidArgumentError):
        DevicePool(indexer_spec, 8, "cpu", latent)  # another size
    with pytest.raises(InvalidArgumentError):
        DevicePool(latent_spec, 16, "cpu", latent)  # owns its slots
    with pytest.raises(InvalidArgumentError):
        device_pools(model, {}, "cpu")
    with pytest.raises(InvalidArgumentError):
        device_pools(model, {"latent": 16, "kv": 16}, "cpu")
    with pytest.raises(InvalidArgumentError):
        DevicePool("latent", 16, "cpu")  # type: ignore[arg-type]


def test_hybrid_state_pools_count_snapshots() -> None:
    model = preset(PoolPreset.HYBRID)
    pools = device_pools(model, {"kv": 32, "conv": 3}, "cpu")
    conv, ssm = pools["conv"], pools["ssm"]
    assert (conv.size, ssm.size, conv.page_size) == (3, 3, 1)
    assert ssm.buffer.dtype == torch.float32 and ssm.buffer.shape[2] == 3
    snap = conv.alloc(1)
    assert snap is not None and conv.alloc(3) is None and conv.available_size == 2


def test_default_device_and_unavailable_cuda() -> None:
    (spec,) = preset(PoolPreset.MLA).pools
    assert DevicePool(spec, 4).device.type == default_device().type
    assert default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError):
            DevicePool(spec, 4, "cuda")
    with pytest.raises(ConfigError):
        DevicePool(spec, 4, "meta")


def test_indexer_pack_round_trip_is_exact() -> None:
    keys = random_like((5, 16), torch.float8_e4m3fn, 3)
    scales = torch.linspace(-2.0, 7.5, 5)
    packed = pack_indexer(keys, scales)
    assert packed.shape == (5, 20) and packed.dtype == torch.uint8
    got_keys, got_scales = unpack_indexer(packed)
    assert torch.equal(as_bytes(got_keys), as_bytes(keys))
    assert torch.equal(got_scales, scales)
    with pytest.raises(LayoutError):
        pack_indexer(keys, scales[:4])
    with pytest.raises(LayoutError):
        pack_indexer(keys.view(torch.uint8).float(), scales)
    with pytest.raises(LayoutError):
        unpack_indexer(packed.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_indexer_as_float_is_the_fp8_value_times_the_scale(dtype: torch.dtype) -> None:
    """Every fp8 byte (both signs, subnormals, zeros, the largest) decodes to torch's own
    conversion; only NaN reads as 480. Products with the moved scale are exact."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(16, 16)
    scales = torch.tensor([2.0**-20, 0.5, 1.0, 3.0, 1e-3, 7.25, 448.0, 1e6] * 2)
    keys, moved = indexer_as_float(pack_indexer(every, scales), dtype)
    assert keys.dtype == dtype and moved.dtype == dtype and keys.shape == (16, 16)
    expected = every.to(torch.float64)
    nan = torch.isnan(expected)
    assert int(nan.sum()) == 2
    assert torch.equal(keys.double()[~nan] * 256, expected[~nan])
    assert torch.equal(keys.double()[nan].abs() * 256, torch.full((2,), 480.0, dtype=torch.float64))
    assert torch.equal(moved.double(), scales.to(dtype).double() * 256)
    if dtype == torch.float64:  # the product is the one an fp8-to-float conversion gives
        direct = every.to(torch.float64) * scales.double()[:, None]
        assert torch.equal((keys * moved[:, None])[~nan], direct[~nan])


def test_take_rows_is_advanced_indexing() -> None:
    source = torch.randn(50, 3, 4)
    index = torch.randint(0, 50, (6, 7, 2))
    assert torch.equal(take_rows(source, index), source[index])
    strided = torch.randn(2, 50, 5)[1]  # a view, as a pool layer is
    assert torch.equal(take_rows(strided, index[0]), strided[index[0]])
    with pytest.raises(IndexError):
        take_rows(source, torch.tensor([50]))


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])]
)
def test_fp8_and_nan_payloads_round_trip_bit_exact(device: str) -> None:
    for dtype in (DType.FLOAT8_E4M3FN, DType.FLOAT16, DType.FLOAT32, DType.INT64):
        spec = PoolSpec("kv", LayoutSpec.mha(2, 2, 8, 4, dtype))
        pool = DevicePool(spec, 8, device)
        assert pool.device == pool.buffer.device
        slots = torch.tensor([4, 5, 6, 7])
        data = data_for(pool, 4, 9)
        pool.write(slots, data)
        assert torch.equal(as_bytes(pool.read(slots)), as_bytes(data))
        assert pool.read(slots).dtype == dtype.to_torch()


def test_repr_names_the_pool() -> None:
    spec = PoolSpec("kv", preset(PoolPreset.DENSE).pools[0].layout)
    assert "kv" in repr(DevicePool(spec, 8, "cpu"))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", PRESETS)
def test_cuda_device_pool_write_read_exact(name: PoolPreset) -> None:
    pools = pools_of(preset(name), device="cuda")
    for seed, pool in enumerate(pools.values()):
        assert pool.device.type == "cuda" and pool.buffer.is_cuda
        if not pool.owns_slots:
            continue
        slots = pool.alloc(pool.page_size)
        assert slots is not None
        data = data_for(pool, slots.numel(), seed)
        pool.write(slots, data)  # a CPU tensor: copied to the device
        assert torch.equal(as_bytes(pool.read(slots)), as_bytes(data))
