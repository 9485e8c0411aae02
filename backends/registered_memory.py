"""Backends that move objects straight from and to memory registered with them.

A backend that transfers by address (RDMA, NIXL, a store mapping the caller's memory) must know
the memory first; registering a whole host pool once, at setup, is cheap, and per-request
registration is not. Such a backend implements :class:`MemoryRegistrar`. Segments of a ``put``
or ``get_into`` that lie inside registered memory then move without a copy; others go through
the backend's staging buffer, counted as ``bytes_staged`` in its stats.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["MemoryRegistrar"]


@runtime_checkable
class MemoryRegistrar(Protocol):
    """A backend that takes registered memory (checked with ``isinstance`` at run time)."""

    def register_memory(self, buffer: Any) -> bool:
        """Register a C-contiguous buffer that stays alive and unchanged in size until
        :meth:`unregister_memory` or close; False when it already lies in registered memory."""
        ...

    def unregister_memory(self, buffer: Any) -> bool:
        """Undo :meth:`register_memory` for the same buffer; False if it was not registered."""
        ...
