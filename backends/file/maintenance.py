"""What the operating tools (``hicache verify``, ``hicache compact``) check a backend for.

Two optional capabilities beyond :class:`~hicache.backends.base.StorageBackend`, offered today
by the ``file`` backend (:mod:`.store_maintenance`); tools test for them with ``isinstance`` and
fall back to the plain API where a backend has neither:

- :class:`BulkReader`: read every object once, checking each one as it lands. Listing, then
  fetching in batches, then checking makes each object cross the event loop and a thread hop
  several times, and a large payload is checksummed long after its read, on cold caches; a
  backend that walks its own storage instead reads each object into a reusable buffer in a
  worker and calls the tool's check right there, and only the results come back, in batches.
- :class:`TempFileOwner`: list and remove the temporary files that writers which crashed
  left behind (:class:`TempFile`), never one younger than :data:`TEMP_GRACE_S`.
- :class:`SegmentStore`: a store that appends objects into segments (``disk``): an audit of
  its segments, which names each damaged stretch and the objects it lost, and a compaction
  that moves live objects out of mostly dead segments.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, TypeVar, runtime_checkable

__all__ = [
    "TEMP_GRACE_S",
    "BulkReader",
    "DamagedStretch",
    "ObjectBatches",
    "ObjectCheck",
    "SegmentStore",
    "TempFile",
    "TempFileOwner",
]

T = TypeVar("T")
#: A tool's check of one object, ``check(key, data)``; ``data`` is valid during the call only.
ObjectCheck: TypeAlias = Callable[[str, memoryview], T]
#: The checks' results, a batch at a time.
ObjectBatches: TypeAlias = AsyncGenerator[list[T], None]
# A temporary file younger than this may belong to a write in progress: never removed.
TEMP_GRACE_S = 15 * 60.0


@runtime_checkable
class BulkReader(Protocol):
    def read_all(
        self, prefix: str, check: ObjectCheck[T], *, threads: int = 2, processes: int = 0
    ) -> ObjectBatches[T]:
        """``check(key, data)`` for every object whose key starts with ``prefix``, in batches.

        ``check`` runs in a worker thread and ``data`` is only valid during the call (the buffer
        is reused): return what is needed, never the view. Objects removed while the walk runs
        are skipped; an object is read at most once. Closing the iterator early waits for the
        reads in flight. With ``processes`` > 1 a backend may run ``check`` in worker processes
        instead: it must then be picklable (a module-level function), and so must its results.
        """
        ...


@dataclass(frozen=True, slots=True)
class TempFile:
    """A writer's temporary file (``path`` relative to the store), as a cleaner sees it."""

    path: str
    size: int
    age_s: float  # seconds since it was last written


@runtime_checkable
class TempFileOwner(Protocol):
    """A backend whose writers leave temporary files when they crash (``file``)."""

    def scan_temp_files(self) -> AsyncIterator[TempFile]:
        """Every temporary file in the store, whatever its age."""
        ...

    async def remove_temp_files(self, min_age_s: float = TEMP_GRACE_S) -> list[TempFile]:
        """Remove temporary files not written for ``min_age_s`` seconds; those removed."""
        ...


@runtime_checkable
class DamagedStretch(Protocol):
    """A stretch of a segment that does not check out, and the objects stored in it."""

    segment: str
    start: int
    end: int
    keys: tuple[str, ...]

    def to_json(self) -> dict[str, object]: ...


@runtime_checkable
class SegmentStore(Protocol):
    """A store of segments (``disk``)."""

    async def audit_segments(self) -> Sequence[DamagedStretch]:
        """Every damaged stretch of every segment, with the objects each one lost."""
        ...

    async def compact_segments(self, min_dead: float = 0.5) -> tuple[int, int]:
        """Move live objects out of segments at least ``min_dead`` dead and reclaim those;
        (segments reclaimed, bytes freed)."""
        ...
