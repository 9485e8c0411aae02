"""Host pools: sizes, protection, page buffers, and device -> host -> device exactness."""

from __future__ import annotations

import pytest
import torch
from cuda_kit import needs_cuda
from pool_bytes_kit import as_bytes, random_like

from hicache.errors import (
    ConfigError,
    DoubleFreeError,
    InvalidArgumentError,
    LayoutError,
    UnsupportedLayoutError,
)
from hicache.layouts import KV_LAYOUTS, Layout, TransferStream
from hicache.pools import (
    DevicePool,
    HostPool,
    ModelPools,
    PoolPreset,
    device_pools,
    host_pools,
    preset,
)

PRESETS = list(PoolPreset)
DENSE = preset(PoolPreset.DENSE).pools[0]


def fill(pool: DevicePool, slots: torch.Tensor, seed: int) -> torch.Tensor:
    layout = pool.spec.layout
    shape = (layout.num_components, layout.layers, slots.numel(), *layout.item_shape)
    data = random_like(shape, pool.buffer.dtype, seed)
    pool.write(slots, data)
    return data


def round_trip(model: ModelPools, layout: Layout, device: str) -> None:
    """Fill 3 device pages of every pool, back them up to scattered host pages, free and
    reallocate the device pages elsewhere, load back, and compare every byte."""
    slots = {p.name: 6 * p.page_size for p in model if not p.shares_slots_with}
    dev = device_pools(model, slots, device)
    host = host_pools(model, {p.name: 5 for p in model if not p.shares_slots_with}, layout)
    for name, pool in dev.items():
        assert pool.device.type == device
        if not pool.owns_slots:
            continue
        group = [pool, *(dev[s.name] for s in model.sidecars(name))]
        hosts = [host[p.spec.name] for p in group]
        slots = pool.alloc(3 * pool.page_size)
        pages = hosts[0].alloc(3)
        assert slots is not None and pages is not None
        pages = pages.flip(0)  # host pages in another order than the device pages
        want = [fill(p, slots, seed) for seed, p in enumerate(group)]
        for p, h in zip(group, hosts):
            transfer = h.backup(p, slots, pages)
            transfer.synchronize()
            assert transfer.layers == tuple(range(p.spec.layout.layers)) and transfer.done()
        spacer = pool.alloc(pool.page_size)  # the load lands on other device pages
        pool.free(slots)
        again = pool.alloc(3 * pool.page_size)
        assert again is not None and spacer is not None
        for p, h, data in zip(group, hosts, want):
            p.buffer.zero_()
            transfer = h.load(pages, p, again)
            for layer in transfer.layers:
                transfer.wait_layer(layer)
            transfer.synchronize()
            assert torch.equal(as_bytes(p.read(again)), as_bytes(data)), p.spec.name


@pytest.mark.parametrize("layout", KV_LAYOUTS, ids=lambda x: x.label)
@pytest.mark.parametrize("name", PRESETS)
def test_device_host_device_is_exact(name: PoolPreset, layout: Layout) -> None:
    round_trip(preset(name), layout, "cpu")


def test_sizes_in_pages_and_slots() -> None:
    host = HostPool(DENSE, 6, Layout.PAGE_FIRST, pin_memory=False)
    assert (host.num_pages, host.page_size, host.pinned) == (6, 4, False)
    pages = host.alloc(4)
    assert pages is not None
    assert (host.available_pages, host.used_pages, host.protected_pages) == (2, 4, 0)
    host.protect(pages[:2])
    host.protect(pages[:1])
    assert (host.available_size, host.used_size, host.protected_size) == (8, 16, 8)
    host.release(pages[:1])
    assert host.protected_pages == 2
    host.release(pages[1:2])
    assert host.protected_pages == 1  # page 0 was protected twice
    host.release(pages[:1])
    assert host.protected_pages == 0 and not host.is_protected(pages).any()
    assert host.alloc(3) is None and host.available_pages == 2
    assert host.buffer.shape[0] == 6 and not host.buffer.is_pinned()


def test_protected_pages_cannot_be_freed() -> None:
    host = HostPool(DENSE, 4, pin_memory=False)
    pages = host.alloc(3)
    assert pages is not None
    host.protect(pages[1:2])
    with pytest.raises(InvalidArgumentError):
        host.free(pages)
    assert host.is_allocated(pages).all() and host.available_pages == 1
    host.release(pages[1:2])
    host.free(pages)
    assert host.available_pages == 4


def test_bad_page_operations_are_typed_and_change_nothing() -> None:
    host = HostPool(DENSE, 4, pin_memory=False)
    pages = host.alloc(2)
    assert pages is not None
    host.free(pages[:1])
    with pytest.raises(DoubleFreeError):
        host.free(pages)  # one free, one allocated: nothing freed
    assert host.is_allocated(pages[1:]).all()
    with pytest.raises(DoubleFreeError):
        host.free([int(pages[1]), int(pages[1])])
    assert host.available_pages == 3
    for bad in ([4], [-1], [0.5]):
        with pytest.raises(InvalidArgumentError):
            host.free(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        host.protect(pages[:1])  # a free page
    with pytest.raises(InvalidArgumentError):
        host.release(pages[1:])  # not protected
    assert host.protected_pages == 0 and host.available_pages == 3


def test_bad_transfers_are_typed_and_change_nothing() -> None:
    dev = DevicePool(DENSE, 16, "cpu")
    host = HostPool(DENSE, 4, pin_memory=False)
    other = preset(PoolPreset.MLA).pools[0]
    slots, pages = dev.alloc(4), host.alloc(1)
    assert slots is not None and pages is not None
    fill(dev, slots, 7)
    device_before, host_before = dev.buffer.clone(), host.buffer.clone()
    cases = [
        (DevicePool(other, 16, "cpu"), slots, pages),  # another pool's spec
        (dev, slots, [3]),  # an unallocated host page
        (dev, torch.arange(4, 8), pages),  # unallocated device slots
        (dev, torch.arange(16, 20), pages),  # out of range
        (dev, torch.tensor([0, 1, 1, 2]), pages),  # repeated
        (dev, slots, [4]),  # page out of range
    ]
    for device, s, p in cases:
        with pytest.raises(InvalidArgumentError):
            host.backup(device, s, p)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            host.load(p, device, s)  # type: ignore[arg-type]
    with pytest.raises(LayoutError):
        host.backup(dev, slots[:3], pages)  # not a whole page of slots
    assert torch.equal(as_bytes(dev.buffer), as_bytes(device_before))
    assert torch.equal(as_bytes(host.buffer), as_bytes(host_before))


def test_backup_of_some_layers_only() -> None:
    dev = DevicePool(DENSE, 8, "cpu")
    host = HostPool(DENSE, 2, Layout.PAGE_FIRST_DIRECT, pin_memory=False)
    slots, pages = dev.alloc(4), host.alloc(1)
    assert slots is not None and pages is not None
    data = fill(dev, slots, 3)
    transfer = host.backup(dev, slots, pages, layers=[1], stream=TransferStream("cpu"))
    assert transfer.layers == (1,)
    dev.buffer.zero_()
    host.load(pages, dev, slots).synchronize()
    assert torch.equal(as_bytes(dev.read(slots, layer=1)), as_bytes(data[:, 1]))
    assert bool((dev.read(slots, layer=0) == 0).all())


@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT])
def test_page_buffer_is_a_contiguous_view(layout: Layout) -> None:
    host = HostPool(DENSE, 3, layout, pin_memory=False)
    view = host.page_buffer(1)
    assert view.is_contiguous() and view.numel() * view.element_size() == DENSE.page_bytes
    view.fill_(3.0)
    assert bool((host.read_page(1) == 3).all()) and bool((host.read_page(0) == 0).all())
    (segment,) = host.page_segments(2)
    segment[:] = bytes([0x40]) * len(segment)  # bf16 0x4040 = 3.0
    assert torch.equal(host.read_page(2), host.read_page(1))
    with pytest.raises(InvalidArgumentError):
        host.page_buffer(3)


def test_layer_first_pages_are_segments_not_one_buffer() -> None:
    host = HostPool(DENSE, 2, Layout.LAYER_FIRST, pin_memory=False)
    with pytest.raises(UnsupportedLayoutError):
        host.page_buffer(0)
    segments = host.page_segments(1)
    layout = DENSE.layout
    assert len(segments) == layout.num_components * layout.layers
    assert sum(len(s) for s in segments) == DENSE.page_bytes


def test_write_page_then_read_page() -> None:
    host = HostPool(DENSE, 2, pin_memory=False)
    page = random_like(host.read_page(0).shape, torch.bfloat16, 5)
    host.write_page(1, page)
    assert torch.equal(as_bytes(host.read_page(1)), as_bytes(page))
    host.write_page(0, as_bytes(page))  # flat bytes work too
    assert torch.equal(as_bytes(host.read_page(0)), as_bytes(page))
    with pytest.raises(LayoutError):
        host.write_page(0, page.float())
    with pytest.raises(InvalidArgumentError):
        host.read_page(2)


def test_sidecar_host_pool_shares_pages_and_protection() -> None:
    model = preset(PoolPreset.DSA)
    host = host_pools(model, {"latent": 4}, Layout.PAGE_FIRST, pin_memory=False)
    latent, indexer = host["latent"], host["indexer"]
    assert indexer.allocator is latent.allocator and indexer.num_pages == 4
    pages = latent.alloc(2)
    assert pages is not None
    indexer.protect(pages[:1])  # e.g. the indexer page is being written to storage
    with pytest.raises(InvalidArgumentError):
        latent.free(pages)
    with pytest.raises(InvalidArgumentError):
        indexer.free(pages)
    with pytest.raises(InvalidArgumentError):
        indexer.alloc(1)
    assert latent.available_pages == 2
    indexer.release(pages[:1])
    latent.free(pages)
    assert indexer.available_pages == 4
    with pytest.raises(InvalidArgumentError):
        HostPool(model.pool("indexer"), 4, pin_memory=False)  # no owner
    with pytest.raises(InvalidArgumentError):
        HostPool(model.pool("indexer"), 3, pin_memory=False, owner=latent)
    with pytest.raises(InvalidArgumentError):
        host_pools(model, {"latent": 4, "other": 1}, pin_memory=False)


def test_bad_construction() -> None:
    with pytest.raises(UnsupportedLayoutError):
        HostPool(DENSE, 2, Layout.RAW, pin_memory=False)
    with pytest.raises(InvalidArgumentError):
        HostPool(DENSE, 2, "page_first", pin_memory=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        HostPool(DENSE, 0, pin_memory=False)
    with pytest.raises(InvalidArgumentError):
        HostPool(DENSE.layout, 2, pin_memory=False)  # type: ignore[arg-type]


def test_pinning_follows_cuda() -> None:
    assert HostPool(DENSE, 1).pinned == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError):
            HostPool(DENSE, 1, pin_memory=True)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("layout", KV_LAYOUTS, ids=lambda x: x.label)
@pytest.mark.parametrize("name", PRESETS)
def test_cuda_device_host_device_is_exact(name: PoolPreset, layout: Layout) -> None:
    round_trip(preset(name), layout, "cuda")


@pytest.mark.cuda
@needs_cuda
def test_cuda_host_pool_is_pinned_and_events_complete() -> None:
    dev = DevicePool(DENSE, 16)
    host = HostPool(DENSE, 4, Layout.PAGE_FIRST)
    assert dev.buffer.is_cuda and host.pinned and host.buffer.is_pinned()
    slots, pages = dev.alloc(8), host.alloc(2)
    assert slots is not None and pages is not None
    data = fill(dev, slots, 11)
    stream = TransferStream(dev.device)
    host.backup(dev, slots, pages, stream=stream).synchronize()
    dev.buffer.zero_()
    transfer = host.load(pages, dev, slots, stream=stream)
    transfer.wait_layer(0)  # the current stream waits for layer 0 only
    got0 = dev.read(slots, layer=0)
    transfer.synchronize()
    assert transfer.done()
    assert torch.equal(as_bytes(got0), as_bytes(data[:, 0]))
    assert torch.equal(as_bytes(dev.read(slots)), as_bytes(data))
