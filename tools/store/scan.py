"""Reading a whole store for the operating tools: open it, then stream every object with its
header checked, in bounded parallel batches.

Two depths (:class:`ReadMode`): ``HEADERS`` reads the first :data:`HEADER_SIZE` bytes of each
object (``peek``) and checks the header and that the listed size is the one it records;
``FULL`` reads every byte into reusable buffers and also checks the payload checksum. Objects
that disappear between the listing and the read (evicted or deleted by a serving process) are
counted as ``vanished`` and skipped: they are not damage.

Before the first object is handed out the scanner makes sure the store holds hicache pages at
all: when none of the first ``sample`` objects starts with the page magic, pointing a tool at
it is a mistake (a wrong directory), and it raises :class:`BadMagicError` so that nothing is
deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import os
import re
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.backends.base import MISS, ObjectInfo, StorageBackend
from hicache.backends.registry import default_registry
from hicache.codec import HEADER_SIZE, MAGIC, PageHeader, check_page, parse_header, verify_page
from hicache.errors import (
    BackendUnavailableError,
    BadMagicError,
    CodecError,
    ConfigError,
    CorruptHeaderError,
    ForeignPageError,
    InvalidArgumentError,
    TruncatedPageError,
    UnsupportedVersionError,
)
from hicache.tools.progress import Progress

__all__ = [
    "Damage",
    "PageKeyParts",
    "Problem",
    "ReadMode",
    "ScanOptions",
    "ScannedObject",
    "StoreScanner",
    "check_whole",
    "open_store",
    "parse_page_key",
    "recheck",
    "refuse_store",
    "store_config",
]

_PAGE_KEY_RE = re.compile(r"([0-9a-f]{16})-([0-9a-f]{16})-([0-9a-f]{64})\Z")
_NO_PARENT_HEX = "0" * 64


class Problem(enum.Enum):
    """Why an object is bad."""

    CORRUPT = "corrupt"  # header or payload checksum, a field out of range, trailing bytes
    TRUNCATED = "truncated"  # shorter than its header says, or than a header
    FOREIGN = "foreign"  # not a hicache page, or a page written under another key
    UNSUPPORTED = "unsupported_version"  # a page of a format version this build cannot read

    @property
    def removable(self) -> bool:
        """Whether tools may delete such an object: a newer writer's pages are not garbage."""
        return self is not Problem.UNSUPPORTED

    @classmethod
    def of(cls, exc: CodecError) -> Problem:
        if isinstance(exc, TruncatedPageError):
            return cls.TRUNCATED
        if isinstance(exc, (BadMagicError, ForeignPageError)):
            return cls.FOREIGN
        if isinstance(exc, UnsupportedVersionError):
            return cls.UNSUPPORTED
        return cls.CORRUPT


class ReadMode(enum.Enum):
    HEADERS = "headers"
    FULL = "full"


@dataclass(frozen=True, slots=True)
class PageKeyParts:
    """The fields of a page key ``{namespace}-{format}-{page hash}`` (all hex)."""

    namespace: str
    fmt: str
    page_hash: str

    def parent_key(self, parent_hash: bytes) -> str | None:
        """The key of the page before this one in its chain; None for a chain's first page."""
        parent = parent_hash.hex()
        return None if parent == _NO_PARENT_HEX else f"{self.namespace}-{self.fmt}-{parent}"


def parse_page_key(key: str) -> PageKeyParts | None:
    """The fields of a page key, or None for a key of another shape (its chain is unknown)."""
    match = _PAGE_KEY_RE.match(key)
    return None if match is None else PageKeyParts(*match.groups())


@dataclass(frozen=True, slots=True)
class ScannedObject:
    """One stored object: what the listing said, and its header or what is wrong with it."""

    info: ObjectInfo
    header: PageHeader | None
    problem: Problem | None = None
    detail: str = ""
    has_magic: bool = True  # starts like a hicache page, even if something else is wrong

    @property
    def key(self) -> str:
        return self.info.key


@dataclass(frozen=True, slots=True)
class ScanOptions:
    mode: ReadMode = ReadMode.HEADERS
    prefix: str = ""
    parallel: int = 2  # batches in flight; more only adds contention on a small machine
    batch_objects: int = 256
    batch_bytes: int = 32 << 20  # FULL mode: the size of one batch's reusable buffer
    sample: int = 64  # objects looked at before deciding that a store is not a hicache store

    def __post_init__(self) -> None:
        if min(self.parallel, self.batch_objects, self.batch_bytes, self.sample) <= 0:
            raise InvalidArgumentError("parallel, batch sizes and sample must be positive")


async def open_store(url: str, *, read_only: bool = False) -> StorageBackend:
    """Open the store at ``url`` for a tool; raises a :class:`HiCacheError` when it cannot:
    what :func:`store_config` refuses, and stores that cannot list their objects.

    ``read_only``: for the tools that only read (``verify`` without deletion, ``inspect``,
    ``stats``). A backend with a read-only mode (a ``read_only`` option: ``file``) opens in it
    and writes nothing, not even at open, so a read-only mount or a snapshot can be checked;
    its writes then raise :class:`~hicache.errors.ReadOnlyStoreError`. Other backends
    open as usual.
    """
    cls, config = store_config(url, read_only=read_only)
    backend = await cls.open(config)
    if not backend.capabilities.listable:
        await backend.close()
        raise ConfigError(f"{url}: the {cls.name} backend cannot list its objects")
    return backend


def store_config(url: str, *, read_only: bool = False) -> tuple[type[StorageBackend], Any]:
    """The backend class and config :func:`open_store` opens ``url`` with, checked without
    opening anything (so a caller can tell a URL that names no store from a store that does not
    open): refuses unknown schemes, stores a separate process cannot see (``memory://``), and a
    local root that does not exist (the file backend would create it)."""
    cls, backend_url = default_registry.resolve_url(url)
    config = cls.config_from_url(backend_url, {})
    if read_only and "read_only" in getattr(config, "__dataclass_fields__", ()):
        config = dataclasses.replace(config, read_only=True)
    caps = cls.capabilities
    if not (caps.persistent or caps.shared_across_processes):
        raise ConfigError(f"{url}: a {cls.name} store lives inside one process; nothing to open")
    root = getattr(config, "root", None)
    if isinstance(root, str) and not os.path.isdir(root):
        raise BackendUnavailableError(f"{url}: no store at {root} (no such directory)")
    return cls, config


def _check(info: ObjectInfo, data: memoryview, mode: ReadMode) -> ScannedObject:
    try:
        if mode is ReadMode.FULL:
            return ScannedObject(info, check_page(info.key, data))
        header = parse_header(info.key, data)
        if info.size != header.object_len:
            kind = TruncatedPageError if info.size < header.object_len else CorruptHeaderError
            raise kind(f"{info.key}: {info.size} bytes, the header says {header.object_len}")
        return ScannedObject(info, header)
    except CodecError as exc:
        # Keep what an intact header says (pool, position) for listings of damaged pages.
        header_or_none = _header_or_none(info.key, data)
        has_magic = bytes(data[:4]) == MAGIC
        return ScannedObject(info, header_or_none, Problem.of(exc), str(exc), has_magic)


def _header_or_none(key: str, data: memoryview) -> PageHeader | None:
    try:
        return parse_header(key, data)
    except CodecError:
        return None


def refuse_store(seen: int) -> None:
    """Raise BadMagicError: none of the first ``seen`` objects was a hicache page."""
    raise BadMagicError(
        f"not a hicache store: none of the first {seen} objects is a hicache page "
        "(check the URL); nothing was changed"
    )


@dataclass(frozen=True, slots=True)
class Damage:
    """A bad object, as :func:`check_whole` found it."""

    key: str
    size: int
    problem: Problem
    detail: str
    has_magic: bool  # starts like a hicache page, even if something else is wrong


def check_whole(key: str, data: memoryview) -> int | Damage:
    """The check of a whole-store read (a :class:`BulkReader` callback): the size of a good
    object, else what is wrong with it. Lean on purpose: it runs once per object."""
    try:
        verify_page(key, data)
    except CodecError as exc:
        return Damage(key, data.nbytes, Problem.of(exc), str(exc), bytes(data[:4]) == MAGIC)
    return data.nbytes


class StoreScanner:
    """``async for obj in StoreScanner(backend, options)``: every object, in no set order.

    After the loop, ``objects``, ``nbytes`` and ``vanished`` say what was seen.
    """

    def __init__(
        self, backend: StorageBackend, options: ScanOptions, progress: Progress | None = None
    ) -> None:
        self.backend = backend
        self.options = options
        self.progress = progress
        self.objects = 0
        self.nbytes = 0
        self.vanished = 0
        self._buffers: list[bytearray] = []

    def __aiter__(self) -> AsyncGenerator[ScannedObject, None]:
        return self.stream()

    async def stream(self) -> AsyncGenerator[ScannedObject, None]:
        """The objects; close it early with ``contextlib.aclosing`` to cancel reads in flight."""
        held: list[ScannedObject] | None = []  # until the store is known to hold pages
        async with contextlib.aclosing(self._completed()) as batches:
            async for batch in batches:
                if held is None:
                    for obj in batch:
                        yield obj
                    continue
                held.extend(batch)
                if any(obj.has_magic for obj in held):
                    for obj in held:
                        yield obj
                    held = None
                elif len(held) >= self.options.sample:
                    self._refuse(len(held))
        if held:
            self._refuse(len(held))

    def _refuse(self, seen: int) -> None:
        refuse_store(seen)

    async def _completed(self) -> AsyncGenerator[list[ScannedObject], None]:
        """Checked batches as they complete, at most ``parallel`` in flight.

        The listing runs as its own task, a few batches ahead, so that it goes on while reads
        are awaited: a file store's listing is itself many thread hops.
        """
        queue: asyncio.Queue[list[ObjectInfo] | None] = asyncio.Queue(self.options.parallel)
        producer = asyncio.ensure_future(self._produce(queue))
        reads: set[asyncio.Future[list[ScannedObject]]] = set()
        getter: asyncio.Future[list[ObjectInfo] | None] | None = None
        listed = False
        try:
            while True:
                if getter is None and not listed and len(reads) < self.options.parallel:
                    getter = asyncio.ensure_future(queue.get())
                waiting: set[asyncio.Future[Any]] = set(reads)
                waiting.update(f for f in (getter, producer) if f is not None and not f.done())
                if not waiting:
                    return
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if producer.done():
                    producer.result()  # raises the listing's error, if it failed
                if getter is not None and getter.done():
                    batch, getter = getter.result(), None
                    if batch is None:
                        listed = True
                    else:
                        reads.add(asyncio.ensure_future(self._read(batch)))
                for task in done & reads:
                    reads.discard(task)
                    yield task.result()
        finally:
            leftovers = [f for f in (producer, getter, *reads) if f is not None]
            for future in leftovers:
                future.cancel()
            await asyncio.gather(*leftovers, return_exceptions=True)

    async def _produce(self, queue: asyncio.Queue[list[ObjectInfo] | None]) -> None:
        async for batch in self._batches():
            await queue.put(batch)
        await queue.put(None)  # the end; a failed listing ends with the task's error instead

    async def _batches(self) -> AsyncIterator[list[ObjectInfo]]:
        opts = self.options
        batch: list[ObjectInfo] = []
        nbytes = 0
        async for info in self.backend.scan(opts.prefix):
            full = opts.mode is ReadMode.FULL and nbytes + info.size > opts.batch_bytes
            if batch and (len(batch) >= opts.batch_objects or full):
                yield batch
                batch, nbytes = [], 0
            batch.append(info)
            nbytes += info.size
        if batch:
            yield batch

    async def _read(self, batch: list[ObjectInfo]) -> list[ScannedObject]:
        if self.options.mode is ReadMode.HEADERS:
            heads = await self.backend.peek([i.key for i in batch], HEADER_SIZE)
            found = [(i, memoryview(h)) for i, h in zip(batch, heads) if h is not None]
            out = [_check(info, head, ReadMode.HEADERS) for info, head in found]
        else:
            out = await self._read_full(batch)
        self._account(batch, out)
        return out

    async def _read_full(self, batch: list[ObjectInfo]) -> list[ScannedObject]:
        need = sum(i.size for i in batch)
        buffer = self._take_buffer(need)
        try:
            views, offset = [], 0
            whole = memoryview(buffer)
            for info in batch:
                views.append(whole[offset : offset + info.size])
                offset += info.size
            sizes = await self.backend.get_into([i.key for i in batch], views)
            found: list[tuple[ObjectInfo, memoryview]] = []
            for info, view, n in zip(batch, views, sizes):
                if n > view.nbytes:  # replaced by a larger object since it was listed
                    (data,) = await self.backend.get([info.key], size_hint=n)
                    if data is not None:
                        found.append(
                            (ObjectInfo(info.key, len(data), info.mtime), memoryview(data))
                        )
                elif n != MISS:
                    found.append((info, view[:n]))
            # The checksums release the GIL: off the event loop, next to the reads in flight.
            return await asyncio.to_thread(_check_all, found)
        finally:
            self._buffers.append(buffer)

    def _take_buffer(self, need: int) -> bytearray:
        for i, buf in enumerate(self._buffers):
            if len(buf) >= need:
                return self._buffers.pop(i)
        if self._buffers:
            self._buffers.pop()  # too small for this batch: replaced, so the pool stays bounded
        return bytearray(max(need, min(self.options.batch_bytes, 1 << 20)))

    def _account(self, batch: Sequence[ObjectInfo], out: Sequence[ScannedObject]) -> None:
        nbytes = sum(obj.info.size for obj in out)
        self.objects += len(out)
        self.nbytes += nbytes
        self.vanished += len(batch) - len(out)
        if self.progress is not None:
            self.progress.advance(len(out), nbytes)


def _check_all(found: list[tuple[ObjectInfo, memoryview]]) -> list[ScannedObject]:
    return [_check(info, data, ReadMode.FULL) for info, data in found]


async def recheck(backend: StorageBackend, keys: Sequence[str]) -> list[str]:
    """Those of ``keys`` that are still present and still bad, read and checked again now.

    Run just before deleting: a serving process may have rewritten a page since the scan.
    """
    still_bad: list[str] = []
    for start in range(0, len(keys), 64):
        chunk = list(keys[start : start + 64])
        for key, data in zip(chunk, await backend.get(chunk, size_hint=HEADER_SIZE)):
            if data is not None:
                obj = _check(ObjectInfo(key, len(data), 0.0), memoryview(data), ReadMode.FULL)
                if obj.problem is not None and obj.problem.removable:
                    still_bad.append(key)
    return still_bad
