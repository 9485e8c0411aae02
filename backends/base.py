"""The storage backend contract.

A backend stores opaque byte objects under validated string keys. It knows nothing of trees,
models or layouts. Subclasses implement the ``_``-prefixed coroutines; the public methods here
validate every argument once, keep the common counters and refuse calls after ``close()``, so a
backend never re-checks keys itself.

Buffers: a value is one buffer or a sequence of buffers (scatter-gather segments, for example a
page header and a view of the payload), all C-contiguous. ``put`` copies what it needs before it
returns; the caller may reuse its buffers at once. ``get_into`` fills caller-owned buffers.
The helpers for such values live in :mod:`hicache.backends.segments` and are re-exported here.
Which calls may overlap, on which event loop, and what a cancelled call owes its caller: see
the concurrency contract in :class:`StorageBackend`'s docstring.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeAlias, TypeVar
from urllib.parse import parse_qsl, urlsplit

from hicache.backends.segments import (
    BufferLike,
    Segments,
    as_segments,
    copy_if_fits,
    copy_into_segments,
    fill_from_segments,
    join_segments,
    segments_nbytes,
)
from hicache.errors import (
    BackendClosedError,
    ConfigError,
    InvalidArgumentError,
    ReadOnlyStoreError,  # re-exported: it was defined here before hicache.errors held it
)
from hicache.keys import validate_key, validate_key_prefix
from hicache.typed_config import build_config

__all__ = [
    "MISS",
    "BufferLike",
    "Capabilities",
    "ObjectInfo",
    "ReadOnlyStoreError",
    "Segments",
    "StorageBackend",
    "UrlPart",
    "as_segments",
    "copy_if_fits",
    "copy_into_segments",
    "fill_from_segments",
    "join_segments",
    "segments_nbytes",
]

UrlPart: TypeAlias = Literal["host", "path"]
MISS = -1
B = TypeVar("B", bound="StorageBackend")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend guarantees; tests and callers branch on these, never on the class."""

    persistent: bool = False  # objects survive close() and a process restart
    shared_across_processes: bool = False  # another process opening the same URL sees them
    zero_copy: bool = False  # reads and writes go straight to or from registered memory
    listable: bool = True  # scan() works; if not, scan() raises a HiCacheError
    max_object_bytes: int | None = None  # larger objects are refused by put
    # get_into checked the stored payload checksum of every hicache page it returned that is
    # larger than this many bytes (disk://, as it reads); a reader's codec need not hash those
    # payloads again (codec.check_into's payload_checked). None: it checks no page's own sum.
    checks_pages_over: int | None = None


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One stored object, as ``scan`` reports it."""

    key: str
    size: int
    mtime: float


def _validate_keys(keys: Sequence[str]) -> list[str]:
    if isinstance(keys, (str, bytes)):
        raise InvalidArgumentError("pass a sequence of keys, not a single key")
    return [validate_key(k) for k in keys]


class StorageBackend(abc.ABC):
    """Async object store over validated keys. See the module docstring for buffer rules.

    Concurrency contract: what hicache's callers do, and so what every backend must take.

    - **One event loop.** Every call on an instance, the synchronous ones included
      (``register_memory``, ``unregister_memory``), is made on the thread of the loop it was
      opened on: the tiered cache's loop, the SGLang adapter's loop thread, LMCache's storage
      loop. A backend may bind locks, semaphores and sessions to that loop at open; blocking
      work goes to threads, never onto the loop. A backend that blocks in its coroutines
      anyway is run behind :class:`~hicache.backends.wrappers.ThreadedBackend`.
    - **Calls overlap.** Any number of ``exists``, ``get_into``, ``put``, ``put_missing``,
      ``delete``, ``peek``, ``scan`` and ``stats`` calls may be in flight at once, from several
      tasks: the storage tier runs its writer tasks (``exists``, then ``put`` batches) beside
      its prefetch tasks (``exists``, ``get_into`` batches, ``delete`` of pages that failed
      their checks). Batches in flight together may name the same key: a reader then gets
      the old object or the new one whole, never a mix.
    - **Calls are cancelled** (a deadline passed, a shutdown). A cancelled ``put`` leaves the
      old object or the whole new one. A cancelled call ends only when nothing of the backend
      touches the caller's buffers any more (a thread still copying is waited for:
      :func:`~hicache.backends._io_threads.outlive_cancel`): the caller reuses them at once.
    - **close() comes last.** Callers close once every other call of theirs has returned (the
      storage tier stops its tasks first); a call after it raises ``BackendClosedError``.

    The conformance suite (:mod:`hicache.backends.testing`) checks each point a backend can
    show: overlapping batches, overwrites racing reads, cancelled reads and writes.
    """

    name: ClassVar[str]
    url_schemes: ClassVar[tuple[str, ...]] = ()
    #: The parts of ``scheme://host/path`` the backend gives a meaning to (see
    #: :meth:`url_location_fields`); a URL with a part it does not claim is refused.
    url_parts: ClassVar[frozenset[UrlPart]] = frozenset()
    # A class default, not a ClassVar: a wrapper backend reports its inner backend's per instance.
    capabilities: Capabilities = Capabilities()
    config_type: ClassVar[type[Any]]

    def __init__(self) -> None:
        self._closed = False
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "get_hits",
                "get_misses",
                "get_too_small",
                "bytes_read",
                "puts",
                "put_failures",
                "bytes_written",
                "deletes",
                # Bytes copied through a buffer of the backend's own between the caller's
                # memory and the store (not the store's own copy); a backend that stages
                # counts them, one that never does reports 0 from here.
                "bytes_staged",
            ),
            0,
        )

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def config_from_url(cls, url: str, overrides: Mapping[str, Any]) -> Any:
        """The backend's config from ``scheme://location?option=value`` plus ``overrides``.

        Query options and overrides are config fields; the location is given to
        :meth:`url_location_fields`, which a backend overrides to say what it means. A query
        option may not set a field the location already sets (``file:///a?root=/b``): one of
        the two would be dropped silently, so the URL is refused.
        """
        scheme, sep, rest = url.partition("://")
        # Parsed as a neutral scheme: urlsplit drops a scheme that starts with a digit ("3fs").
        parts = urlsplit("x://" + rest if sep else url)
        shown = scheme if sep else cls.name
        cls._refuse_unclaimed_parts(shown, parts.netloc, parts.path)
        values: dict[str, Any] = dict(cls.url_location_fields(parts.netloc, parts.path))
        query = parse_qsl(parts.query, keep_blank_values=True)
        for name, value in query:
            if values.get(name) not in (None, ""):
                raise ConfigError(
                    f"{shown}:// URL gives {name} twice: {values[name]!r} from its location and "
                    f"{value!r} from ?{name}=; give it once, in the location"
                )
        values.update(query)
        values.update(overrides)
        return build_config(cls.config_type, values)

    @classmethod
    def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
        """Config fields named by the URL's location part; none by default.

        Called only with the parts the backend claims in :attr:`url_parts`; the others are
        empty (a path of just ``/`` counts as empty).
        """
        return {}

    @classmethod
    def _refuse_unclaimed_parts(cls, scheme: str, netloc: str, path: str) -> None:
        # A part the backend ignores would be silently dropped: memory://cache-a and
        # memory://cache-b would open the same kind of store, which their author did not mean.
        found: dict[UrlPart, str] = {
            "host": netloc.rpartition("@")[2],  # the user part may hold credentials: not shown
            "path": "" if path == "/" else path,
        }
        for part, value in found.items():
            if value and part not in cls.url_parts:
                claimed = " and ".join(sorted(cls.url_parts)) or "no location"
                raise ConfigError(
                    f"{scheme}:// URLs take no {part} (got {value!r}): the {cls.name} backend "
                    f"reads {claimed} from its URL; give options as ?name=value"
                )

    @classmethod
    async def open(cls: type[B], config: Any) -> B:
        """Open a backend from its config. Backends that connect override this."""
        return cls(config)  # type: ignore[call-arg]

    # ----- public API (validated) -----------------------------------------------------------
    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether an object is stored under it."""
        self._check_open()
        checked = _validate_keys(keys)
        return await self._exists(checked) if checked else []

    async def get_into(self, keys: Sequence[str], buffers: Sequence[Segments]) -> list[int]:
        """Read each object into its buffer.

        Per key: ``MISS`` (-1) when absent; else the object's size ``n``. When ``n`` is larger
        than the buffer, nothing useful was read (the buffer's contents are unspecified) and the
        caller can retry with ``n`` bytes, as :meth:`get` does.
        """
        self._check_open()
        checked = _validate_keys(keys)
        if len(buffers) != len(checked):
            raise InvalidArgumentError(f"{len(checked)} keys but {len(buffers)} buffers")
        segments = [as_segments(b, writable=True) for b in buffers]
        if not checked:
            return []
        results = await self._get_into(checked, segments)
        hits = misses = too_small = nbytes = 0  # summed locally, stored once
        for n, segs in zip(results, segments, strict=True):
            if n < 0:
                misses += 1
            elif n > segments_nbytes(segs):
                too_small += 1
            else:
                hits += 1
                nbytes += n
        c = self._counters
        c["get_hits"] += hits
        c["get_misses"] += misses
        c["get_too_small"] += too_small
        c["bytes_read"] += nbytes
        return results

    async def put(self, keys: Sequence[str], values: Sequence[Segments]) -> list[bool]:
        """Store each value under its key, replacing what was there; True where it was stored.

        A put that fails for a storage reason (full, I/O error) is False and counted, never
        an exception; an object visible under a key is always complete.
        """
        checked, segments = self._put_batch(keys, values)
        if not checked:
            return []
        results = await self._put(checked, segments)
        stored = sum(results)
        c = self._counters
        c["puts"] += stored
        c["put_failures"] += len(results) - stored
        c["bytes_written"] += sum(
            segments_nbytes(segs) for ok, segs in zip(results, segments, strict=True) if ok
        )
        return results

    async def put_missing(self, keys: Sequence[str], values: Sequence[Segments]) -> list[bool]:
        """Store each value whose key holds no object; a key that holds one keeps it.

        True where the key holds an object afterwards (this value or the one already there).
        For pages named by their content, whose object never changes, this is a put that skips
        what is stored; a backend with a native form (one call instead of an existence check
        and a put) overrides :meth:`_put_missing`. Failures are False, as in :meth:`put`.
        """
        checked, segments = self._put_batch(keys, values)
        return await self._put_missing(checked, segments) if checked else []

    def _put_batch(
        self, keys: Sequence[str], values: Sequence[Segments]
    ) -> tuple[list[str], list[list[memoryview]]]:
        """A put batch's keys and values once checked: open, valid keys, one value each."""
        self._check_open()
        checked = _validate_keys(keys)
        if len(values) != len(checked):
            raise InvalidArgumentError(f"{len(checked)} keys but {len(values)} values")
        if len(set(checked)) != len(checked):
            raise InvalidArgumentError("a put batch names the same key twice")
        return checked, [as_segments(v, writable=False) for v in values]

    async def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key; True where an object was there."""
        self._check_open()
        checked = _validate_keys(keys)
        results = await self._delete(checked) if checked else []
        self._counters["deletes"] += sum(results)
        return results

    def scan(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every stored object whose key starts with ``prefix``, in no particular order."""
        self._check_open()
        return self._scan(validate_key_prefix(prefix))

    async def stats(self) -> dict[str, int | float]:
        """Counters kept by the base plus the backend's own (sizes, evictions, errors).

        ``bytes_staged`` is always there: 0 unless the backend copies through staging.
        """
        merged: dict[str, int | float] = dict(self._counters)
        if not self._closed:
            merged.update(await self._stats())
        return merged

    async def close(self) -> None:
        """Release resources; later calls raise :class:`BackendClosedError`. Idempotent."""
        if not self._closed:
            self._closed = True
            await self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self: B) -> B:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----- concrete helpers -----------------------------------------------------------------
    async def leading_hits(self, keys: Sequence[str], batch_size: int = 128) -> int:
        """How many keys from the start exist without a gap: the prefix rule of L3 hits.

        Asks in batches and stops at the first batch with a miss, so a long chain whose
        beginning is missing costs one round trip. Every key is validated first, so a bad key
        raises whatever is stored.
        """
        self._check_open()
        checked = _validate_keys(keys)
        if batch_size <= 0:
            raise InvalidArgumentError("batch_size must be positive")
        hits = 0
        for start in range(0, len(checked), batch_size):
            self._check_open()  # close() may have run while the previous batch was in flight
            found = await self._exists(checked[start : start + batch_size])
            for present in found:
                if not present:
                    return hits
                hits += 1
        return hits

    async def get(self, keys: Sequence[str], size_hint: int = 1 << 20) -> list[bytes | None]:
        """Each object as new bytes, None for a miss. Convenience, not the zero-copy path.

        One batched read into ``size_hint``-byte buffers, then a read of just the objects that
        did not fit, at the size they reported.
        """
        self._check_open()
        checked = _validate_keys(keys)
        out: list[bytes | None] = [None] * len(checked)
        sizes = [max(size_hint, 0)] * len(checked)
        pending = list(range(len(checked)))
        # An object replaced by a larger one between attempts needs another try; three is
        # plenty, since a key names one page and its size never changes in normal use.
        for _ in range(3):
            if not pending:
                break
            buffers = [bytearray(sizes[i]) for i in pending]
            results = await self.get_into([checked[i] for i in pending], buffers)
            retry: list[int] = []
            for i, buf, n in zip(pending, buffers, results, strict=True):
                if n > len(buf):
                    sizes[i] = n
                    retry.append(i)
                elif n >= 0:
                    out[i] = bytes(buf) if n == len(buf) else bytes(memoryview(buf)[:n])
            pending = retry
        return out

    async def peek(self, keys: Sequence[str], nbytes: int) -> list[bytes | None]:
        """The first ``nbytes`` of each object (all of it when shorter), None for a miss.

        For tools that read page headers only. Backends that can read part of an object
        override :meth:`_peek`; the default reads whole objects through :meth:`get`.
        """
        self._check_open()
        checked = _validate_keys(keys)
        if not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be a non-negative int, got {nbytes!r}")
        return await self._peek(checked, nbytes) if checked else []

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError(f"{type(self).__name__} is closed")

    def _count(self, counter: str, amount: int = 1) -> None:
        self._counters[counter] = self._counters.get(counter, 0) + amount

    # ----- what a backend implements ----------------------------------------------------------
    async def _peek(self, keys: list[str], nbytes: int) -> list[bytes | None]:
        """Optional fast path of :meth:`peek` (keys validated, at least one)."""
        whole = await self.get(keys, size_hint=nbytes)
        return [None if data is None else data[:nbytes] for data in whole]

    @abc.abstractmethod
    async def _exists(self, keys: list[str]) -> list[bool]: ...

    @abc.abstractmethod
    async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]: ...

    @abc.abstractmethod
    async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]: ...

    async def _put_missing(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
        """What :meth:`put_missing` does by default: an existence check, then :meth:`put` of
        the keys without an object (counted as puts there)."""
        present = await self._exists(keys)
        todo = [i for i, found in enumerate(present) if not found]
        results = [bool(found) for found in present]
        if todo:
            stored = await self.put([keys[i] for i in todo], [values[i] for i in todo])
            for i, ok in zip(todo, stored, strict=True):
                results[i] = ok
        return results

    @abc.abstractmethod
    async def _delete(self, keys: list[str]) -> list[bool]: ...

    @abc.abstractmethod
    def _scan(self, prefix: str) -> AsyncIterator[ObjectInfo]: ...

    async def _stats(self) -> dict[str, int | float]:
        """The backend's own counters, merged over the base's by :meth:`stats`; none by default."""
        return {}

    async def _close(self) -> None:  # noqa: B027 - optional on purpose: many have nothing to free
        """Release the backend's resources, once (the base makes ``close()`` idempotent)."""
