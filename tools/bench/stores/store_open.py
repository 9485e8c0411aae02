"""``hicache bench backends --open-objects N``: the open time of a store of N small objects
left behind by a writer that died.

For ``disk`` (and ``file`` up to :data:`FILE_MAX_OBJECTS` objects: its open stats every
object), a child process builds a store of N objects of :data:`VALUE_BYTES` bytes each,
through the backend in batches of :data:`BUILD_BATCH`, with keys shaped like the tier's
(98 characters: a namespace tag, a format digest and a page hash, in hex). Once its last put
has returned the child leaves with ``os._exit``: no close, so a disk store has no final
snapshot, only the snapshots its writer took on the way (one every ``snapshot_records`` log
records) and the log records after the last one, as after a crash.

The bench process then syncs (untimed), and opens the store :data:`OPENS` times read-only,
each open closed again: a read-only open recovers and rewrites nothing, so every open sees
the same directory. ``open_s`` is the median wall time of ``open_backend`` (URL parsing and
the hop to its thread included), with its range; ``open_cpu_s`` the median process CPU time
of the same. The opens are warm: the store was just written and its files are in the page
cache (a cold open needs the cache dropped, which needs root). After each open the object
count is checked against N and a few objects are read back and compared.

The ``python -m`` entry point is the child's: ``URL OBJECTS``, one JSON line on stdout.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from hicache.backends.disk.format import decode_snapshot
from hicache.backends.registry import open_backend
from hicache.tools.bench.rounds import spread

__all__ = ["BUILD_BATCH", "FILE_MAX_OBJECTS", "OPENS", "VALUE_BYTES", "run_open_bench"]

VALUE_BYTES = 64
BUILD_BATCH = 4096  # objects a put: a million objects in 245 calls
OPENS = 3
FILE_MAX_OBJECTS = 200_000  # one file per object: building and opening more takes minutes
_OPENABLE = ("disk", "file")
# A namespace tag and a format digest (16 hex digits each), then a page hash: 98 characters.
_KEY_HEAD = "3f1c0ad29b6e4d75-8a0e6b4c2f19d3e7-"
_BUILD_TIMEOUT_S = 3600


def tier_keys(lo: int, hi: int) -> list[str]:
    """Keys of objects ``lo`` to ``hi - 1``, shaped like the tier's storage keys."""
    return [_KEY_HEAD + hashlib.sha256(i.to_bytes(8, "little")).hexdigest() for i in range(lo, hi)]


def _values() -> np.ndarray:
    """BUILD_BATCH random values: object ``i`` holds row ``i % BUILD_BATCH``."""
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, size=(BUILD_BATCH, VALUE_BYTES), dtype=np.uint8)


# ----- the child: build, then die without a close ----------------------------------------------
async def _build(url: str, objects: int) -> dict[str, Any]:
    backend = await open_backend(url)
    values = _values()
    rows = [values[j] for j in range(BUILD_BATCH)]
    start = time.perf_counter()
    for lo in range(0, objects, BUILD_BATCH):
        hi = min(lo + BUILD_BATCH, objects)
        if not all(await backend.put(tier_keys(lo, hi), rows[: hi - lo])):
            raise RuntimeError(f"{backend.name}: a put failed while building the store")
    stats = await backend.stats()
    return {"build_s": round(time.perf_counter() - start, 3), "snapshots": stats.get("snapshots")}


async def _child(url: str, objects: int) -> None:
    print(json.dumps(await _build(url, objects)), flush=True)
    # No close, no interpreter teardown: the writer ends as a killed one would.
    os._exit(0)


def _build_in_child(url: str, objects: int) -> dict[str, Any]:
    """Build the store in a child process (see the module's docstring); what it printed."""
    proc = subprocess.run(
        [sys.executable, "-m", "hicache.tools.bench.stores.store_open", url, str(objects)],
        capture_output=True,
        text=True,
        timeout=_BUILD_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = (proc.stderr or "").strip()[-2000:]
        raise RuntimeError(f"building the store failed (exit {proc.returncode}): {tail}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


# ----- the bench process: time read-only opens ---------------------------------------------------
async def _timed_open(url: str, objects: int) -> tuple[float, float, dict[str, Any]]:
    """Wall and process CPU seconds of one read-only open; its stats, after checking them."""
    start, cpu = time.perf_counter(), time.process_time()
    backend = await open_backend(url)
    wall, used = time.perf_counter() - start, time.process_time() - cpu
    try:
        stats = await backend.stats()
        if stats["objects"] != objects:
            raise RuntimeError(f"{backend.name}: opened {stats['objects']} of {objects} objects")
        await _check_sample(backend, objects)
    finally:
        await backend.close()
    return wall, used, stats


async def _check_sample(backend: Any, objects: int) -> None:
    """The first, a middle and the last object read back as they were written."""
    values = _values()
    picks = sorted({0, objects // 2, objects - 1})
    keys = [tier_keys(i, i + 1)[0] for i in picks]
    dest = np.zeros((len(picks), VALUE_BYTES), dtype=np.uint8)
    got = await backend.get_into(keys, [dest[j] for j in range(len(picks))])
    want = values[[i % BUILD_BATCH for i in picks]]
    if any(n != VALUE_BYTES for n in got) or not np.array_equal(dest, want):
        raise RuntimeError(f"{backend.name}: objects read back after the open differ")


def _disk_state(root: str, objects: int) -> dict[str, Any]:
    """What the dead writer left: the snapshot's entries and bytes, the logs' bytes. Every
    object is one PUT record of a new key, so the records an open replays from the logs are
    the objects the snapshot lacks."""
    index = os.path.join(root, "index")
    snapshot = os.path.join(index, "snapshot")
    in_snapshot, snapshot_bytes = 0, 0
    if os.path.exists(snapshot):
        with open(snapshot, "rb") as f:
            data = f.read()
        snap = decode_snapshot(data)
        in_snapshot, snapshot_bytes = (len(snap.keys) if snap else 0), len(data)
    logs = [e for e in os.scandir(index) if e.name.endswith(".log")]
    return {
        "snapshot_objects": in_snapshot,
        "log_records": objects - in_snapshot,
        "snapshot_bytes": snapshot_bytes,
        "log_files": len(logs),
        "log_bytes": sum(e.stat().st_size for e in logs),
    }


async def _bench_store_open(name: str, objects: int, directory: str | None) -> dict[str, Any]:
    scratch = tempfile.mkdtemp(prefix="hicache-bench-open-", dir=directory)
    try:
        root = os.path.join(scratch, "store")
        built = await asyncio.to_thread(_build_in_child, f"{name}://{root}", objects)
        state = _disk_state(root, objects) if name == "disk" else {}
        walls, cpus, backend_s = [], [], []
        for _ in range(OPENS):
            await asyncio.to_thread(os.sync)  # untimed: no writeback during an open
            wall, used, stats = await _timed_open(f"{name}://{root}?read_only=true", objects)
            walls.append(wall)
            cpus.append(used)
            backend_s.append(float(stats.get("open_s", 0.0)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out: dict[str, Any] = {"backend": name, "open_objects": objects, "objects": stats["objects"]}
    out.update(value_bytes=VALUE_BYTES, build_s=built["build_s"], opens=OPENS)
    out.update(spread("open_s", walls, 4))
    out["open_cpu_s"] = round(statistics.median(cpus), 4)
    if name == "disk":
        # The backend's own open time: the same open without URL parsing and the thread hop.
        out["open_s_backend"] = round(statistics.median(backend_s), 4)
        out.update(snapshots_written=built["snapshots"], segments=stats.get("segments"), **state)
    return out


async def run_open_bench(
    backends: tuple[str, ...], objects: int, directory: str | None = None
) -> list[dict[str, Any]]:
    """One row per backend: its open figures, or why it has none (``skipped``)."""
    rows: list[dict[str, Any]] = []
    for name in backends:
        skip = None
        if name not in _OPENABLE:
            skip = "no open benchmark (disk and file have one)"
        elif name == "file" and objects > FILE_MAX_OBJECTS:
            skip = f"file's open stats every object: only up to {FILE_MAX_OBJECTS} objects"
        if skip:
            rows.append({"backend": name, "open_objects": objects, "skipped": skip})
        else:
            rows.append(await _bench_store_open(name, objects, directory))
    return rows


if __name__ == "__main__":
    asyncio.run(_child(sys.argv[1], int(sys.argv[2])))
