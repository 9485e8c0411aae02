"""An optional capability of a backend: read every object once, checking each one as it lands.

Tools that read a whole store (``hicache verify``) otherwise list, then fetch in batches, then
check: each object crosses the event loop and a thread hop several times, and a large payload is
checksummed long after its read, on cold caches. A backend that can walk its own storage offers
:class:`BulkReader` instead: worker threads read each object into a reusable buffer and call
the tool's ``check`` right there, and only the results come back, in batches. Tools test for it
with ``isinstance(backend, BulkReader)`` and fall back to ``scan`` + ``get_into`` otherwise.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Protocol, TypeVar, runtime_checkable

__all__ = ["BulkReader"]

T = TypeVar("T")


@runtime_checkable
class BulkReader(Protocol):
    def read_all(
        self,
        prefix: str,
        check: Callable[[str, memoryview], T],
        *,
        threads: int = 2,
        processes: int = 0,
    ) -> AsyncGenerator[list[T], None]:
        """``check(key, data)`` for every object whose key starts with ``prefix``, in batches.

        ``check`` runs in a worker thread and ``data`` is only valid during the call (the buffer
        is reused): return what is needed, never the view. Objects removed while the walk runs
        are skipped; an object is read at most once. Closing the iterator early waits for the
        reads in flight. With ``processes`` > 1 a backend may run ``check`` in worker processes
        instead: it must then be picklable (a module-level function), and so must its results.
        """
        ...
