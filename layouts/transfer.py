"""Copies between the device pool and host pages, layer by layer, with one event per layer.

The device pool is a ``layer_first`` buffer ``(C, L, S, *item)`` on the compute device; host
buffers are in any KV layout. ``gather`` copies device slots into host pages (back-up), and
``scatter`` copies host pages into device slots (load-back). Slot ``j`` of the slot list holds
token ``j % page_size`` of page ``pages[j // page_size]``.

On CUDA the copies run on the :class:`TransferStream`'s own stream, which first waits for the
current stream; after each layer's copy an event is recorded, so a forward pass can wait for
layer ``i`` only (:meth:`LayerTransfer.wait_layer`). A CPU host buffer must then be pinned: the
copy kernels address it directly (unified addressing), so a page set scattered over the host
buffer moves in one kernel per layer at close to copy-engine speed, with no staging copy.
On the CPU the same calls copy synchronously and every event is already complete.

Everything is checked before the first copy: a bad buffer, an index out of range or repeated
raises :class:`~hicache.errors.LayoutError` and changes nothing. Indices are checked on the
CPU; pass CPU tensors or lists (a CUDA index tensor costs a device synchronisation).
Buffers must stay alive and untouched until the transfer is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from hicache.dtypes import Layout
from hicache.errors import LayoutError
from hicache.layouts._plans import CopyPlan, IndexLike, make_plan
from hicache.layouts.spec import LayoutSpec

__all__ = ["LayerEvent", "LayerTransfer", "TransferStream", "gather", "scatter"]


class LayerEvent(Protocol):
    """What :class:`torch.cuda.Event` offers and a completed CPU copy imitates."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def wait(self, stream: Any = None) -> None: ...


class _CompletedEvent:
    """The event of a copy that ran synchronously on the CPU."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


_COMPLETED = _CompletedEvent()


class LayerTransfer:
    """One gather or scatter in flight: a completion event per layer, in the order issued."""

    def __init__(self, layers: tuple[int, ...], events: Sequence[LayerEvent]) -> None:
        self.layers = layers
        self._events = dict(zip(layers, events))

    def event(self, layer: int) -> LayerEvent:
        try:
            return self._events[layer]
        except KeyError:
            raise LayoutError(f"layer {layer!r} is not part of this transfer") from None

    def wait_layer(self, layer: int) -> None:
        """Make the current CUDA stream wait until ``layer`` is copied; no block on the host."""
        self.event(layer).wait()

    def synchronize_layer(self, layer: int) -> None:
        """Block the calling thread until ``layer`` is copied."""
        self.event(layer).synchronize()

    def layer_done(self, layer: int) -> bool:
        return self.event(layer).query()

    def synchronize(self) -> None:
        for event in self._events.values():
            event.synchronize()

    def done(self) -> bool:
        return all(event.query() for event in self._events.values())


class TransferStream:
    """Where layer copies run: a dedicated stream on a CUDA device, the caller's thread on the
    CPU. Transfers issued on one stream complete in issue order."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:  # compare equal to the pool's device, "cuda:N"
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        elif self.device.type == "cpu":
            self.stream = None
        else:
            raise LayoutError(f"transfers run on cpu or cuda, not {self.device}")

    def gather(
        self,
        device_kv: torch.Tensor,
        slots: IndexLike,
        host: torch.Tensor,
        pages: IndexLike,
        spec: LayoutSpec,
        layout: Layout,
        layers: Sequence[int] | None = None,
    ) -> LayerTransfer:
        """Copy device ``slots`` into host ``pages`` (a ``layout`` buffer), per layer."""
        return self._run(make_plan(device_kv, slots, host, pages, spec, layout, layers), True)

    def scatter(
        self,
        host: torch.Tensor,
        pages: IndexLike,
        device_kv: torch.Tensor,
        slots: IndexLike,
        spec: LayoutSpec,
        layout: Layout,
        layers: Sequence[int] | None = None,
    ) -> LayerTransfer:
        """Copy host ``pages`` (a ``layout`` buffer) into device ``slots``, per layer."""
        return self._run(make_plan(device_kv, slots, host, pages, spec, layout, layers), False)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _run(self, plan: CopyPlan, to_host: bool) -> LayerTransfer:
        if plan.device != self.device:
            raise LayoutError(f"the pool is on {plan.device}; this stream is on {self.device}")
        if self.stream is None:
            plan.copy_all(to_host)
            return LayerTransfer(plan.layers, [_COMPLETED] * len(plan.layers))
        # The pool's slots may just have been written (or freed) by work on the current stream.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        events: list[LayerEvent] = []
        with torch.cuda.stream(self.stream):
            plan = plan.to_device()
            for layer in plan.layers:
                plan.copy_layer(layer, to_host)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self.stream)
                events.append(event)
        return LayerTransfer(plan.layers, events)


def _device_of(device_kv: object) -> torch.device:
    if not isinstance(device_kv, torch.Tensor):
        raise LayoutError(f"the device pool must be a torch.Tensor, not {type(device_kv).__name__}")
    return device_kv.device


def gather(
    device_kv: torch.Tensor,
    slots: IndexLike,
    host: torch.Tensor,
    pages: IndexLike,
    spec: LayoutSpec,
    layout: Layout,
    *,
    layers: Sequence[int] | None = None,
    stream: TransferStream | None = None,
) -> LayerTransfer:
    """Copy device pool ``slots`` into host ``pages``; on ``stream`` or a fresh one."""
    stream = stream or TransferStream(_device_of(device_kv))
    return stream.gather(device_kv, slots, host, pages, spec, layout, layers)


def scatter(
    host: torch.Tensor,
    pages: IndexLike,
    device_kv: torch.Tensor,
    slots: IndexLike,
    spec: LayoutSpec,
    layout: Layout,
    *,
    layers: Sequence[int] | None = None,
    stream: TransferStream | None = None,
) -> LayerTransfer:
    """Copy host ``pages`` into device pool ``slots``; on ``stream`` or a fresh one."""
    stream = stream or TransferStream(_device_of(device_kv))
    return stream.scatter(host, pages, device_kv, slots, spec, layout, layers)
