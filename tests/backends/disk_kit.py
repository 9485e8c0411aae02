"""Helpers for the disk backend's tests: opening stores, values that name their version, the
files of a store, a writer child process driven through queues, and one that journals every
call it makes.

Values are derived from ``(key, version)`` only, so any process can tell whether bytes read
back are exactly one of the versions written for a key.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hicache.backends.base import MISS
from hicache.backends.disk import DiskBackend, DiskConfig

KIB = 1 << 10
MIB = 1 << 20
HERE = pathlib.Path(__file__).resolve().parent


async def open_disk(root: pathlib.Path, **options: Any) -> DiskBackend:
    return await DiskBackend.open(DiskConfig(root=str(root), **options))


def value_of(key: str, version: int, largest: int = 30000) -> bytes:
    """The bytes of ``key``'s version ``version``: empty for some, else ``key#version#`` and up
    to ``largest`` random bytes."""
    if version % 17 == 0:
        return b""
    size = zlib.crc32(f"{key}#{version}".encode()) % largest
    return f"{key}#{version}#".encode() + random.Random(f"{key}#{version}").randbytes(size)


def version_in(key: str, data: bytes | None, versions: set[int | None]) -> int | None:
    """Which of ``versions`` (None: absent) ``data`` is; raises when it is none of them."""
    if data is None:
        assert None in versions, f"{key}: a miss, but it must be one of versions {versions}"
        return None
    for version in versions:
        if version is not None and value_of(key, version) == data:
            return version
    raise AssertionError(f"{key}: {len(data)} bytes that are none of versions {versions}")


def segment_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted((root / "segments").glob("w*.seg"))


def log_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted((root / "index").glob("w*.log"))


def disk_bytes(root: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in segment_files(root))


def without_closing_snapshot(backend: DiskBackend) -> None:
    """Make ``close()`` skip its snapshot (as when it fails): the logs keep every record."""
    assert backend._appender is not None
    backend._appender.maybe_snapshot = lambda force=False: False  # type: ignore[method-assign]


# ----- a writer child driven through queues ----------------------------------------------------
CTX = multiprocessing.get_context("spawn")


def serve(root: str, commands: Any, replies: Any) -> None:
    """Child: open the store as a writer, report its slot, then run commands until told to
    close (or to exit at once, as a crash would: no closing snapshot)."""

    async def main() -> None:
        backend = await open_disk(pathlib.Path(root), segment_bytes=MIB, snapshot_records=64)
        assert backend._appender is not None
        replies.put(backend._appender.slot)
        while True:
            op, key, version = await asyncio.to_thread(commands.get)
            if op in ("put", "delete", "exists", "get", "fill"):
                replies.put(await _command(backend, op, key, version))
            elif op == "crash":
                os._exit(0)
            else:
                await backend.close()
                replies.put("closed")
                return

    asyncio.run(main())


async def _command(backend: DiskBackend, op: str, key: str, version: int) -> Any:
    if op == "put":
        return await backend.put([key], [value_of(key, version)])
    if op == "delete":
        return await backend.delete([key])
    if op == "exists":
        return await backend.exists([key])
    if op == "get":
        buf = bytearray(32 * KIB)
        (n,) = await backend.get_into([key], [buf])
        return None if n == MISS else bytes(buf[:n])
    # fill: ``version`` pages named ``key``-i, version 1 each, put 8 at a time; their keys
    keys = [f"{key}-{i}" for i in range(version)]
    for start in range(0, len(keys), 8):
        batch = keys[start : start + 8]
        assert await backend.put(batch, [value_of(k, 1) for k in batch]) == [True] * len(batch)
    return keys


class Child:
    """A process running :func:`serve`, its slot taken once constructed."""

    def __init__(self, root: pathlib.Path) -> None:
        self.commands, self.replies = CTX.Queue(), CTX.Queue()
        self.process = CTX.Process(
            target=serve, args=(str(root), self.commands, self.replies), daemon=True
        )  # daemon: a failed test leaves no child behind
        self.process.start()
        self.slot: int = self.reply()

    def reply(self) -> Any:
        return self.replies.get(timeout=30)

    def call(self, op: str, key: str = "", version: int = 0) -> Any:
        self.commands.put((op, key, version))
        return self.reply()

    def end(self, op: str = "close") -> None:
        self.commands.put((op, "", 0))
        self.process.join(30)
        assert self.process.exitcode == 0

    def kill(self) -> None:
        """SIGKILL: nothing of a close runs; the kernel releases the slot's lock."""
        self.process.kill()
        self.process.join(30)
        assert self.process.exitcode == -signal.SIGKILL


# ----- a writer child that journals its calls ---------------------------------------------------
@dataclass
class Journal:
    """What a writer child did: its slot, its acknowledged calls, the call in flight if any.

    A call is ``("P", {key: version})`` or ``("D", {key: None})``.
    """

    slot: int | None = None
    acked: list[tuple[str, dict[str, int | None]]] = field(default_factory=list)
    in_flight: tuple[str, dict[str, int | None]] | None = None
    done: bool = False  # the child closed its store and exited


def read_journal(path: pathlib.Path) -> Journal:
    journal = Journal()
    text = path.read_text() if path.exists() else ""
    for line in text.split("\n")[:-1]:  # a torn last line (no newline) was never acknowledged
        kind, _, rest = line.partition(" ")
        if kind == "S":
            journal.slot = int(rest)
        elif kind == "I":
            op, *items = rest.split()
            if op == "P":
                call = {k: int(v) for k, v in (item.split("=") for item in items)}
                journal.in_flight = ("P", dict(call))
            else:
                journal.in_flight = ("D", dict.fromkeys(items))
        elif kind == "A":
            assert journal.in_flight is not None
            journal.acked.append(journal.in_flight)
            journal.in_flight = None
        elif kind == "Q":
            journal.done = True
    return journal


def writer_pool() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Fixture body: the writer children a test starts, killed at teardown if still running."""
    children: list[subprocess.Popen[bytes]] = []
    yield children
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait()


def start_writer(
    pool: list[subprocess.Popen[bytes]], root: pathlib.Path, journal: pathlib.Path, **job: Any
) -> subprocess.Popen[bytes]:
    """A child running :func:`writer_main` on ``root`` (``job``: prefix, seed, keys, base,
    stop, and store options); its stderr goes to ``journal`` + ``.err``."""
    job = {"root": str(root), "journal": str(journal), **job}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    code = "import sys, json, disk_kit; disk_kit.writer_main(json.loads(sys.argv[1]))"
    with open(f"{journal}.err", "wb") as err:
        child = subprocess.Popen([sys.executable, "-c", code, json.dumps(job)], env=env, stderr=err)
    pool.append(child)
    return child


def child_errors(journal: pathlib.Path) -> str:
    path = pathlib.Path(f"{journal}.err")
    return path.read_text(errors="replace") if path.exists() else ""


def writer_main(job: dict[str, Any]) -> None:
    """Child: put, overwrite and delete batches of ``prefix`` keys until ``stop`` exists,
    journalling each call before it starts (I) and after it returned (A)."""

    async def main() -> None:
        names = ("segment_bytes", "snapshot_records", "fsync", "capacity", "direct")
        options = {k: job[k] for k in names if k in job}
        backend = await open_disk(pathlib.Path(job["root"]), **options)
        fd = os.open(job["journal"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        rng = random.Random(job["seed"])
        keys = [f"{job['prefix']}-{i}" for i in range(job["keys"])]
        version = job["base"]
        assert backend._appender is not None
        os.write(fd, f"S {backend._appender.slot}\n".encode())
        deadline = time.monotonic() + 60  # never outlive a test that forgot to stop it
        while not os.path.exists(job["stop"]) and time.monotonic() < deadline:
            batch = rng.sample(keys, rng.randint(1, 8))
            if rng.random() < 0.75:
                versions = {}
                for key in batch:
                    version += 1
                    versions[key] = version
                line = " ".join(f"{k}={v}" for k, v in versions.items())
                os.write(fd, f"I P {line}\n".encode())
                ok = await backend.put(batch, [value_of(k, versions[k]) for k in batch])
                assert ok == [True] * len(batch), f"put returned {ok}"
            else:
                os.write(fd, f"I D {' '.join(batch)}\n".encode())
                await backend.delete(batch)
            os.write(fd, b"A\n")
        await backend.close()
        os.write(fd, b"Q\n")

    asyncio.run(main())


async def wait_for_acks(path: pathlib.Path, n: int, child: subprocess.Popen[bytes]) -> Journal:
    """The journal once it holds ``n`` acknowledged calls (the child must still be running)."""
    deadline = time.monotonic() + 30
    while True:
        journal = read_journal(path)
        if len(journal.acked) >= n:
            return journal
        if child.poll() is not None:
            raise AssertionError(f"the writer exited ({child.returncode}): {child_errors(path)}")
        assert time.monotonic() < deadline, f"the writer made {len(journal.acked)} calls in 30 s"
        await asyncio.sleep(0.005)


def allowed_after(
    state: dict[str, int | None], journal: Journal
) -> tuple[dict[str, int | None], dict[str, set[int | None]]]:
    """The state once the journal's acknowledged calls are applied, and per key what a reader
    may find: that state, or the call in flight's outcome (None: absent)."""
    state = dict(state)
    for _, call in journal.acked:
        state.update(call)
    allowed = {key: {version} for key, version in state.items()}
    if journal.in_flight is not None:
        for key, version in journal.in_flight[1].items():
            allowed.setdefault(key, {state.get(key)}).add(version)
    return state, allowed


async def check_store(
    backend: DiskBackend, prefix: str, keys: list[str], allowed: dict[str, set[int | None]]
) -> dict[str, int | None]:
    """Every key reads as one of its allowed versions (None: a miss), byte for byte, and
    ``scan`` lists exactly the keys found; what was found, by key."""
    got = await backend.get(keys, size_hint=32 * KIB)
    found = {
        key: version_in(key, data, allowed.get(key, {None}))
        for key, data in zip(keys, got, strict=True)
    }
    listed = sorted([info.key async for info in backend.scan(prefix)])
    assert listed == sorted(k for k, v in found.items() if v is not None)
    return found


def fill_up(path: pathlib.Path) -> None:
    """Write ``path`` until its filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while os.write(fd, bytes(4096)):
            pass
    except OSError as exc:
        assert exc.errno == 28, exc  # ENOSPC
    finally:
        os.close(fd)


def tree_of(directory: pathlib.Path) -> dict[str, tuple[bytes, int] | str]:
    """Every entry below ``directory``: a file's bytes and mtime, a link's target."""
    out: dict[str, tuple[bytes, int] | str] = {}
    for p in sorted(directory.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(directory))] = str(os.readlink(p))
        elif p.is_file():
            out[str(p.relative_to(directory))] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


def outside_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """Fixture body: a directory outside the store, holding one file (``victim``)."""
    place = tmp_path / "outside"
    place.mkdir()
    (place / "victim").write_bytes(b"not the store's")
    return place


def one_line(exc: Any) -> str:
    """The message of a raised error (a ``pytest.ExceptionInfo``), checked to be one line."""
    message = str(exc.value)
    assert message and "\n" not in message
    return message


# ----- small stores for the fault tests ---------------------------------------------------------
KEYS = [f"k{i}" for i in range(12)]


async def stored(root: pathlib.Path, keys: list[str] = KEYS, **options: Any) -> None:
    """A store at ``root`` (64 KiB segments) holding ``keys``, version 1 each, one put each."""
    backend = await open_disk(root, segment_bytes=64 * KIB, **options)
    for key in keys:
        assert await backend.put([key], [value_of(key, 1, 6000)]) == [True]
    await backend.close()


async def expect(backend: DiskBackend, present: list[str], missing: list[str]) -> None:
    """``present`` (as :func:`stored` put them) read back byte-exact, ``missing`` are misses
    (and then not found either)."""
    got = await backend.get(present + missing, size_hint=8 * KIB)
    assert got == [value_of(k, 1, 6000) for k in present] + [None] * len(missing)
    assert await backend.exists(missing) == [False] * len(missing)
