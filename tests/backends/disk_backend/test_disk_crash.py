"""The disk backend's crash campaign: writers killed with SIGKILL at random moments, logs and
segments cut short at random bytes, and what a reopen must then find.

Writer children (:func:`disk_kit.writer_main`) put, overwrite and delete batches of keys in a
loop, with small segments and snapshots every 64 log records, so a kill lands in appends,
rotations and snapshots alike. Each child journals a call before it starts and after it
returned; after the kill, every key must read back as its last acknowledged version or the
outcome of the call in flight, byte for byte: an acknowledged put or delete is never lost (a
kill without power loss leaves the page cache whole, fsync or not), and bytes are never wrong.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import shutil
import signal
import subprocess

import pytest
from disk_kit import (
    KIB,
    MIB,
    Journal,
    allowed_after,
    check_store,
    child_errors,
    log_files,
    open_disk,
    read_journal,
    segment_files,
    start_writer,
    value_of,
    version_in,
    wait_for_acks,
    without_closing_snapshot,
    writer_pool,
)

from hicache.backends.disk.format import LOG_HEADER, decode_log, record_bytes

KEYS = 160
OPTIONS = {"segment_bytes": MIB, "snapshot_records": 64}


def key_space(prefix: str) -> list[str]:
    return [f"{prefix}-{i}" for i in range(KEYS)]


Pool = list[subprocess.Popen[bytes]]
pool = pytest.fixture(writer_pool, name="pool")


async def kill_after(
    path: pathlib.Path, child: subprocess.Popen[bytes], acks: int, rng: random.Random
) -> None:
    """SIGKILL the child once it acknowledged ``acks`` calls and a random pause passed."""
    await wait_for_acks(path, acks, child)
    await asyncio.sleep(rng.uniform(0, 0.05))
    child.kill()
    await asyncio.to_thread(child.wait)
    assert child.returncode == -signal.SIGKILL, child_errors(path)


@pytest.mark.asyncio
async def test_writer_killed_at_random_moments(tmp_path: pathlib.Path, pool: Pool) -> None:
    """Rounds of: a fresh writer takes the killed one's slot (its log recovered), writes, is
    killed; then a reopen (read-only or writing) finds every key exact or, only where no
    acknowledged call says otherwise, missing, and no record fails its checks."""
    root, rng, keys = tmp_path / "store", random.Random(7), key_space("a")
    state: dict[str, int | None] = {}
    slots = []
    for rnd in range(10):
        path = tmp_path / f"journal-{rnd}"
        child = start_writer(
            pool,
            root,
            path,
            prefix="a",
            seed=rnd,
            keys=KEYS,
            base=rnd * 10**6,
            stop=str(tmp_path / "never"),
            fsync=rnd % 3 == 2,
            direct=rnd % 4 == 1,  # O_DIRECT through staging, read back buffered
            **OPTIONS,
        )
        # Round 0 is killed as soon as it wrote once; round 3 while it may still be opening.
        acks = 0 if rnd == 3 else 1 if rnd == 0 else rng.randint(10, 80)
        await kill_after(path, child, acks, rng)
        journal = read_journal(path)
        state, allowed = allowed_after(state, journal)
        backend = await open_disk(root, read_only=rnd % 2 == 0)
        state = await check_store(backend, "a-", keys, allowed)
        stats = await backend.stats()
        await backend.close()
        assert stats["bad_records"] == 0 and stats["lost_segments"] == 0
        if journal.slot is not None:
            slots.append(journal.slot)
    assert set(slots) == {0}  # each writer took the slot the killed one left
    assert sum(v is not None for v in state.values()) > 20  # the rounds did write
    # ... through many segments, log generations and snapshots, so kills landed among them.
    generations = [int(p.name.split(".")[1], 16) for p in log_files(root)]
    assert max(generations) > 10 and (root / "index" / "snapshot").is_file()


@pytest.mark.asyncio
async def test_two_writers_one_killed(tmp_path: pathlib.Path, pool: Pool) -> None:
    """Two writers at once; one is killed, a reader checks its keys while the other writes
    on, a fresh writer takes the dead one's slot and is killed in turn, the other stops
    cleanly: every key of both is exact, nothing acknowledged is lost."""
    root, rng = tmp_path / "store", random.Random(11)
    common = {"keys": KEYS, **OPTIONS}
    paths = {n: tmp_path / f"journal-{n}" for n in ("a", "b", "a2")}
    a = start_writer(
        pool, root, paths["a"], prefix="a", seed=1, base=0, stop="/nonexistent", **common
    )
    b = start_writer(
        pool, root, paths["b"], prefix="b", seed=2, base=0, stop=str(tmp_path / "stop-b"), **common
    )
    await wait_for_acks(paths["b"], 20, b)
    await kill_after(paths["a"], a, 40, rng)
    state_a, allowed = allowed_after({}, read_journal(paths["a"]))
    reader = await open_disk(root, read_only=True)  # b writes on meanwhile: its keys vary
    state_a = await check_store(reader, "a-", key_space("a"), allowed)
    await reader.close()

    a2 = start_writer(
        pool, root, paths["a2"], prefix="a", seed=3, base=10**6, stop="/nonexistent", **common
    )
    await kill_after(paths["a2"], a2, rng.randint(20, 60), rng)
    (tmp_path / "stop-b").touch()
    assert await asyncio.to_thread(b.wait, 30) == 0, child_errors(paths["b"])
    ja, ja2, jb = (read_journal(paths[n]) for n in ("a", "a2", "b"))
    assert ja2.slot == ja.slot != jb.slot and jb.done and jb.in_flight is None

    state_a, allowed_a = allowed_after(state_a, ja2)
    _, allowed_b = allowed_after({}, jb)
    for read_only in (False, True):  # a writer's reopen (it snapshots at close), then a reader's
        backend = await open_disk(root, read_only=read_only)
        found_a = await check_store(backend, "a-", key_space("a"), allowed_a)
        found_b = await check_store(backend, "b-", key_space("b"), allowed_b)
        assert (await backend.stats())["bad_records"] == 0
        await backend.close()
        allowed_a = {k: {v} for k, v in found_a.items()}  # the same again after the reopen
        allowed_b = {k: {v} for k, v in found_b.items()}


@pytest.mark.asyncio
async def test_writer_with_a_capacity_killed(tmp_path: pathlib.Path, pool: Pool) -> None:
    """A writer reclaiming segments (capacity of six) killed at random moments: a key may be
    gone (reclaimed), but never reads as wrong bytes nor as a version older than the last
    one acknowledged, and the disk stays within capacity plus a segment."""
    root, rng, keys = tmp_path / "store", random.Random(13), key_space("c")
    options = {**OPTIONS, "capacity": 6 * MIB}
    state: dict[str, int | None] = {}
    for rnd in range(4):
        path = tmp_path / f"journal-{rnd}"
        child = start_writer(pool, root, path, prefix="c", seed=rnd, keys=KEYS,
                             base=rnd * 10**6, stop="/nonexistent", **options)  # fmt: skip
        await kill_after(path, child, rng.randint(60, 150), rng)
        state, allowed = allowed_after(state, read_journal(path))
        for versions in allowed.values():
            versions.add(None)  # reclaimed
        backend = await open_disk(root, read_only=True)
        state = await check_store(backend, "c-", keys, allowed)
        stats = await backend.stats()
        await backend.close()
        assert stats["bad_records"] == 0 and stats["disk_bytes"] <= 7 * MIB
    assert sum(v is not None for v in state.values()) > 20
    numbers = [int(p.stem[5:], 16) for p in segment_files(root)]
    assert max(numbers) > len(numbers) + 5  # segments were reclaimed along the way


def written(*journals: Journal) -> dict[str, set[int | None]]:
    """Every outcome any of the journals' calls could have left per key (None: absent)."""
    out: dict[str, set[int | None]] = {}
    for journal in journals:
        calls = journal.acked + ([journal.in_flight] if journal.in_flight else [])
        for _, call in calls:
            for key, version in call.items():
                out.setdefault(key, {None}).add(version)
    return out


@pytest.mark.parametrize("snapshot_records", [64, 1 << 20])  # with snapshots, with logs only
@pytest.mark.asyncio
async def test_two_writers_on_the_same_keys(
    tmp_path: pathlib.Path, pool: Pool, snapshot_records: int
) -> None:
    """Two writers put and delete the same keys; the one in slot 1 is killed, the one in slot
    0 writes on and is killed too. A reopen (replaying both logs past the last snapshot,
    slot 0 first) finds each key as one of the versions written, and the keys slot 0 put or
    deleted after the first kill exactly as it left them: its later sequence wins, and its
    delete of what slot 1 put is not undone by replaying slot 1's older PUT."""
    root, rng = tmp_path / "store", random.Random(17)
    px, py = tmp_path / "journal-x", tmp_path / "journal-y"
    common = {"keys": 40, "stop": "/nonexistent", **OPTIONS, "snapshot_records": snapshot_records}
    x = start_writer(pool, root, px, prefix="s", seed=1, base=0, **common)
    await wait_for_acks(px, 1, x)  # x holds slot 0
    y = start_writer(pool, root, py, prefix="s", seed=2, base=10**6, **common)
    await kill_after(py, y, rng.randint(30, 90), rng)
    since = len(read_journal(px).acked) + 1  # calls acknowledged after this began after the kill
    await kill_after(px, x, since + rng.randint(30, 60), rng)
    jx, jy = read_journal(px), read_journal(py)
    assert (jx.slot, jy.slot) == (0, 1)
    allowed = written(jx, jy)
    exact: dict[str, int | None] = {}
    for _, call in jx.acked[since:]:
        exact.update(call)
    for key in jx.in_flight[1] if jx.in_flight else {}:
        exact.pop(key, None)
    assert len(exact) > 5
    allowed.update({key: {version} for key, version in exact.items()})
    keys = key_space("s")[:40]
    for read_only in (True, False, True):
        backend = await open_disk(root, read_only=read_only)
        found = await check_store(backend, "s-", keys, allowed)
        assert (await backend.stats())["bad_records"] == 0
        await backend.close()
        allowed = {k: {v} for k, v in found.items()}  # the same again after each reopen


# ----- torn tails ---------------------------------------------------------------------------------
async def write_history(root: pathlib.Path, rng: random.Random) -> list[tuple[str, int | None]]:
    """One key per call, put or delete (of a present key), closed without the closing
    snapshot: the log holds one record per call, in order. The calls, in order."""
    backend = await open_disk(root, segment_bytes=256 * KIB)
    present: dict[str, int] = {}
    history: list[tuple[str, int | None]] = []
    for version in range(1, 90):
        key = f"k{rng.randrange(25)}"
        if key in present and rng.random() < 0.25:
            assert await backend.delete([key]) == [True]
            del present[key]
            history.append((key, None))
        else:
            assert await backend.put([key], [value_of(key, version)]) == [True]
            present[key] = version
            history.append((key, version))
    without_closing_snapshot(backend)
    await backend.close()
    return history


def state_of(history: list[tuple[str, int | None]]) -> dict[str, set[int | None]]:
    state: dict[str, int | None] = {f"k{i}": None for i in range(25)}
    state.update(history)
    return {key: {version} for key, version in state.items()}


@pytest.mark.asyncio
async def test_log_cut_at_random_bytes(tmp_path: pathlib.Path) -> None:
    """A log cut anywhere (after a close that wrote no snapshot): a reopen replays exactly the
    records before the cut, so every key reads as it was after the calls those records logged;
    a writer then carries the log on and what it adds survives the next reopen."""
    rng = random.Random(5)
    history = await write_history(tmp_path / "orig", rng)
    (log,) = log_files(tmp_path / "orig")
    data = log.read_bytes()
    assert len(decode_log(data, LOG_HEADER)[0]) == len(history)
    cuts = [0, LOG_HEADER - 1, LOG_HEADER, len(data) - 1, *rng.sample(range(len(data)), 12)]
    for n, cut in enumerate(cuts):
        root = tmp_path / f"cut-{n}"
        shutil.copytree(tmp_path / "orig", root)
        os.truncate(root / "index" / log.name, cut)
        whole = len(decode_log(data[:cut], LOG_HEADER)[0]) if cut >= LOG_HEADER else 0
        expected = state_of(history[:whole])
        backend = await open_disk(root, read_only=n % 2 == 0)
        keys = sorted(expected)
        await check_store(backend, "k", keys, expected)
        if n % 2:  # the writer took the slot over: its puts land after the cut, in the log
            assert await backend.put(["k3"], [value_of("k3", 1000)]) == [True]
            expected["k3"] = {1000}
            without_closing_snapshot(backend)
        await backend.close()
        backend = await open_disk(root, read_only=True)
        await check_store(backend, "k", keys, expected)
        await backend.close()


@pytest.mark.asyncio
async def test_segment_cut_at_random_bytes(tmp_path: pathlib.Path) -> None:
    """A segment cut anywhere: the objects whose records end before the cut read exact, those
    past it are misses, whichever version of them an earlier segment still holds."""
    rng = random.Random(9)
    history = await write_history(tmp_path / "orig", rng)
    reader = await open_disk(tmp_path / "orig", read_only=True)
    where = {k: reader.catalog.index.get(k) for k in state_of(history)}
    await reader.close()
    segments = segment_files(tmp_path / "orig")
    assert len(segments) >= 3
    for n in range(10):
        victim = rng.choice(segments)
        code = int(victim.stem[1:4]) << 32 | int(victim.stem[5:], 16)
        cut = rng.randrange(victim.stat().st_size)
        root = tmp_path / f"cut-{n}"
        shutil.copytree(tmp_path / "orig", root)
        os.truncate(root / "segments" / victim.name, cut)
        expected = state_of(history)
        for key, entry in where.items():
            if (
                entry is not None
                and entry[0] == code
                and entry[1] + record_bytes(len(key), entry[2]) > cut
            ):
                expected[key] = {None}
        backend = await open_disk(root, read_only=n % 2 == 1)
        found = await backend.get(sorted(expected), size_hint=32 * KIB)
        for key, data in zip(sorted(expected), found, strict=True):
            version_in(key, data, expected[key])
        await backend.close()
