"""``hicache inspect URL``: what a store holds, from page headers only.

The summary counts objects and bytes per namespace (the first field of a page key; ``other``
for keys of another shape), per pool, per codec and per status, the oldest and newest write,
and the compression ratio (raw payload bytes over stored payload bytes of the valid pages).
``--list`` writes one row per object instead, streamed as the store is read, so a store of any
size is listed in bounded memory.

Row fields (``--format json`` with ``--list`` is one JSON array of such objects; ``key`` is the
same string ``hicache verify`` reports). The Parquet file (``--format parquet --output FILE``,
always one row per object) has this schema:

    key         string, not null     the storage key
    namespace   string               16 hex digits; null when the key is not a page key
    format      string               the storage-format digest, 16 hex digits; null likewise
    pool        string               from the header; null when the header is unreadable
    page_index  uint32               position in its chain; null when unknown
    bytes       int64, not null      stored size, header included
    codec       string               "none" or "zstd_planes"; null when unreadable
    mtime       timestamp[us, UTC]   last write (reads do not change it)
    status      string, not null     "ok", "corrupt", "truncated", "foreign" or
                                     "unsupported_version" (from the header; payload
                                     checksums are ``hicache verify``'s job)

In JSON, ``mtime`` is seconds since the epoch (a float).
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from hicache.backends.base import StorageBackend
from hicache.errors import InvalidArgumentError
from hicache.tools.progress import Progress
from hicache.tools.store.scan import (
    ReadMode,
    ScannedObject,
    ScanOptions,
    StoreScanner,
    parse_page_key,
)

__all__ = ["InspectOptions", "OutputFormat", "StoreSummary", "inspect_store", "object_row"]

_PARQUET_BATCH = 65536
_OTHER = "other"


class OutputFormat(enum.Enum):
    TABLE = "table"
    JSON = "json"
    PARQUET = "parquet"


@dataclass(frozen=True, slots=True)
class InspectOptions:
    list_objects: bool = False
    fmt: OutputFormat = OutputFormat.TABLE
    output: str | None = None  # a file instead of the caller's stream; required for Parquet
    prefix: str = ""
    parallel: int = 2


def object_row(obj: ScannedObject) -> dict[str, Any]:
    """The listing row of one object (see the module docstring)."""
    parts = parse_page_key(obj.key)
    header = obj.header
    return {
        "key": obj.key,
        "namespace": parts.namespace if parts else None,
        "format": parts.fmt if parts else None,
        "pool": header.meta.pool if header else None,
        "page_index": header.meta.page_index if header else None,
        "bytes": obj.info.size,
        "codec": header.codec.name.lower() if header else None,
        "mtime": obj.info.mtime,
        "status": obj.problem.value if obj.problem else "ok",
    }


@dataclass(slots=True)
class _Tally:
    objects: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.objects += 1
        self.bytes += nbytes


def _iso(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


class StoreSummary:
    """Aggregates of a stream of objects: memory grows with namespaces and pools, not objects."""

    def __init__(self) -> None:
        self.total = _Tally()
        self.vanished = 0
        self.raw_payload = 0
        self.stored_payload = 0
        self.oldest: float | None = None
        self.newest: float | None = None
        self.groups: dict[str, defaultdict[str, _Tally]] = {
            name: defaultdict(_Tally) for name in ("namespaces", "pools", "codecs", "status")
        }

    def add(self, obj: ScannedObject) -> None:
        size, mtime, header = obj.info.size, obj.info.mtime, obj.header
        self.total.add(size)
        self.oldest = mtime if self.oldest is None else min(self.oldest, mtime)
        self.newest = mtime if self.newest is None else max(self.newest, mtime)
        parts = parse_page_key(obj.key)
        self.groups["namespaces"][parts.namespace if parts else _OTHER].add(size)
        self.groups["status"][obj.problem.value if obj.problem else "ok"].add(size)
        if header is not None:
            self.groups["pools"][header.meta.pool].add(size)
            self.groups["codecs"][header.codec.name.lower()].add(size)
            self.raw_payload += header.raw_len
            self.stored_payload += header.payload_len

    @property
    def compression_ratio(self) -> float:
        return self.raw_payload / self.stored_payload if self.stored_payload else 1.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "objects": self.total.objects,
            "bytes": self.total.bytes,
            "vanished": self.vanished,
            "oldest": self.oldest,
            "newest": self.newest,
            "raw_payload_bytes": self.raw_payload,
            "stored_payload_bytes": self.stored_payload,
            "compression_ratio": round(self.compression_ratio, 4),
        }
        for name, group in self.groups.items():
            out[name] = {
                k: {"objects": t.objects, "bytes": t.bytes} for k, t in sorted(group.items())
            }
        return out

    def write_table(self, out: TextIO) -> None:
        rows = [
            ("objects", str(self.total.objects)),
            ("bytes", str(self.total.bytes)),
            ("oldest", _iso(self.oldest)),
            ("newest", _iso(self.newest)),
            ("compression", f"{self.compression_ratio:.3f}x"),
        ]
        if self.vanished:
            rows.append(("vanished", f"{self.vanished} (removed while being read)"))
        for label, value in rows:
            out.write(f"{label:<12} {value}\n")
        for name, group in self.groups.items():
            out.write(f"\n{name:<18} {'objects':>10} {'bytes':>16}\n")
            for key, tally in sorted(group.items()):
                out.write(f"{key:<18} {tally.objects:>10} {tally.bytes:>16}\n")


class _RowSink(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class _TextSink:
    """Table or JSON rows to a stream, or to a file opened at the first row (so a run that
    fails before any row leaves no file behind)."""

    def __init__(self, fmt: OutputFormat, out: TextIO, path: str | None) -> None:
        self.fmt = fmt
        self.out = out
        self.path = path
        self.stack = contextlib.ExitStack()
        self.rows = 0

    def _start(self) -> None:
        if self.path is not None:
            self.out = self.stack.enter_context(open(self.path, "w", encoding="utf-8"))  # noqa: SIM115
        if self.fmt is OutputFormat.TABLE:
            self.out.write(
                f"{'key':<98} {'namespace':<16} {'pool':<8} {'index':>6} {'bytes':>12} "
                f"{'codec':<11} {'mtime (UTC)':<19} status\n"
            )
        else:
            self.out.write("[")

    def write(self, row: dict[str, Any]) -> None:
        if self.rows == 0:
            self._start()
        self.rows += 1
        if self.fmt is OutputFormat.JSON:
            self.out.write(("\n" if self.rows == 1 else ",\n") + json.dumps(row))
            return
        index = "-" if row["page_index"] is None else row["page_index"]
        self.out.write(
            f"{row['key']:<98} {row['namespace'] or '-':<16} {row['pool'] or '-':<8} {index:>6} "
            f"{row['bytes']:>12} {row['codec'] or '-':<11} {_iso(row['mtime']):<19} "
            f"{row['status']}\n"
        )

    def close(self) -> None:
        with self.stack:
            if self.rows == 0:
                self._start()
            if self.fmt is OutputFormat.JSON:
                self.out.write("\n]\n")


class _ParquetSink:
    """Rows to a Parquet file in record batches; pyarrow is imported only when used."""

    def __init__(self, path: str) -> None:
        import pyarrow as pa

        self.pa = pa
        self.path = path
        self.schema = pa.schema(
            [
                pa.field("key", pa.string(), nullable=False),
                pa.field("namespace", pa.string()),
                pa.field("format", pa.string()),
                pa.field("pool", pa.string()),
                pa.field("page_index", pa.uint32()),
                pa.field("bytes", pa.int64(), nullable=False),
                pa.field("codec", pa.string()),
                pa.field("mtime", pa.timestamp("us", tz="UTC"), nullable=False),
                pa.field("status", pa.string(), nullable=False),
            ]
        )
        self.columns: dict[str, list[Any]] = {name: [] for name in self.schema.names}
        self.writer: Any = None

    def write(self, row: dict[str, Any]) -> None:
        row = dict(row, mtime=round(row["mtime"] * 1_000_000))
        for name, column in self.columns.items():
            column.append(row[name])
        if len(self.columns["key"]) >= _PARQUET_BATCH:
            self._flush()

    def _flush(self) -> None:
        import pyarrow.parquet as pq

        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, self.schema)
        batch = self.pa.record_batch(list(self.columns.values()), schema=self.schema)
        self.writer.write_batch(batch)
        for column in self.columns.values():
            column.clear()

    def close(self) -> None:
        if self.columns["key"] or self.writer is None:
            self._flush()
        self.writer.close()


def _sink(options: InspectOptions, out: TextIO) -> _RowSink | None:
    if options.fmt is OutputFormat.PARQUET:
        if not options.output:
            raise InvalidArgumentError("--format parquet writes a file: give --output FILE")
        return _ParquetSink(options.output)
    if options.list_objects:
        return _TextSink(options.fmt, out, options.output)
    return None


async def inspect_store(
    backend: StorageBackend,
    options: InspectOptions,
    out: TextIO,
    progress: Progress | None = None,
) -> StoreSummary:
    """Read every header once; write the listing or the summary to ``out`` (or the file)."""
    sink = _sink(options, out)
    summary = StoreSummary()
    scan = ScanOptions(ReadMode.HEADERS, prefix=options.prefix, parallel=options.parallel)
    scanner = StoreScanner(backend, scan, progress)
    async with contextlib.aclosing(scanner.stream()) as objects:
        async for obj in objects:
            summary.add(obj)
            if sink is not None:
                sink.write(object_row(obj))
    summary.vanished = scanner.vanished
    if sink is not None:
        sink.close()
    if sink is None or options.fmt is OutputFormat.PARQUET:
        _write_summary(summary, options, out)
    return summary


def _write_summary(summary: StoreSummary, options: InspectOptions, out: TextIO) -> None:
    path = options.output if options.fmt is not OutputFormat.PARQUET else None
    with open(path, "w", encoding="utf-8") if path else contextlib.nullcontext(out) as stream:
        if options.fmt is OutputFormat.JSON:
            stream.write(json.dumps(summary.to_json(), indent=2) + "\n")
        else:
            summary.write_table(stream)
