"""Helpers for the file backend's tests: opening a store, where an object lives, raw reads."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import xxhash

from hicache.backends.file import FileBackend, FileConfig, tree
from hicache.backends.file.tree import fan_of, make_leaf


def resolve_by(how: str, monkeypatch: pytest.MonkeyPatch, probe: pathlib.Path) -> None:
    """Make this process open keys with ``openat2`` (``how="openat2"``; skips the test where
    the kernel has none) or by walking one component at a time (``"walk"``, the fallback)."""
    if how == "walk":
        monkeypatch.setattr(tree, "_tried", True)
        monkeypatch.setattr(tree, "_openat2", None)
    elif not tree.use_openat2(str(probe)):
        pytest.skip("this kernel has no openat2")


async def open_file(root: pathlib.Path, **options: Any) -> FileBackend:
    return await FileBackend.open(FileConfig(root=str(root), **options))


def files_under(root: pathlib.Path) -> list[str]:
    """Every regular file below ``root``, relative, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def object_path(root: pathlib.Path, key: str) -> pathlib.Path:
    h = xxhash.xxh3_64_hexdigest(key.encode())
    return root / h[0:2] / h[2:4] / key


def write_temp(backend: FileBackend, key: str, data: bytes) -> pathlib.Path:
    """The temporary file a put of ``key`` writes before its rename, through the real write
    path, left in place: what a writer that crashed before the rename leaves."""
    fan = fan_of(key)
    leaf = make_leaf(backend._root, fan, sync=False)
    try:
        name = backend._write_temp(leaf, key, [memoryview(data)], len(data))
    finally:
        os.close(leaf)
    return pathlib.Path(backend._root, fan[:2], fan[2:], name)


async def put_in_order(backend: FileBackend, keys: list[str], value: bytes) -> None:
    """One call per key: the keys of one batch are written in parallel, in no set order."""
    for key in keys:
        assert await backend.put([key], [value]) == [True]


async def read(backend: FileBackend, key: str, size: int) -> bytes | None:
    buf = bytearray(size)
    (n,) = await backend.get_into([key], [buf])
    return None if n < 0 else bytes(buf[:n])


async def opened_store(tmp_path: pathlib.Path) -> AsyncIterator[FileBackend]:
    """A store under ``tmp_path``, closed afterwards: ``store = pytest.fixture(opened_store)``."""
    backend = await open_file(tmp_path / "store")
    yield backend
    await backend.close()


# ----- the link attack: a store whose paths lead outside through symbolic links -------------------
LINK_PLACES = ("top", "sub", "object")  # root/ab, root/ab/cd, root/ab/cd/<key>


def plant_link(root: pathlib.Path, key: str, outside: pathlib.Path, where: str) -> pathlib.Path:
    """Make ``key``'s path lead to ``outside`` through a symbolic link; the victim file there.

    ``where`` is the component replaced by the link: the first fan-out directory (``top``), the
    second (``sub``) or the object itself. Whatever the store held at that place is removed.
    The victim, a file named like the key, is what a link-following backend would read,
    replace or unlink.
    """
    h = xxhash.xxh3_64_hexdigest(key.encode())
    link = {"top": root / h[:2], "sub": root / h[:2] / h[2:4]}.get(where, object_path(root, key))
    victim = {"top": outside / h[2:4] / key}.get(where, outside / key)
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_bytes(b"outside the store: " + key.encode())
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim if where == "object" else outside)
    return victim


def snapshot(directory: pathlib.Path) -> dict[str, tuple[bytes, int]]:
    """Every file below ``directory``: its bytes and mtime (ns), by relative path."""
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def keys_in_distinct_tops(n: int, prefix: str = "key") -> list[str]:
    """``n`` keys whose objects live under different first-level fan-out directories."""
    out: dict[str, str] = {}
    i = 0
    while len(out) < n:
        key = f"{prefix}-{i}"
        out.setdefault(xxhash.xxh3_64_hexdigest(key.encode())[:2], key)
        i += 1
    return list(out.values())


def tiny_tmpfs(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """Fixture body: a 1 MiB tmpfs (real ENOSPC); skipped where mounting is not allowed."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
