"""Prefaulting vLLM's host region (no vLLM needed): a shared mapping is populated in place,
its bytes unchanged; what cannot be populated is left alone."""

from __future__ import annotations

import mmap

from hicache.integrations.vllm.mapping import populate_writable


def test_a_shared_mapping_is_populated_and_keeps_its_bytes() -> None:
    region = mmap.mmap(-1, 64 * mmap.PAGESIZE)  # anonymous shared memory, as /dev/shm maps
    region[:5] = b"kv..."
    view = memoryview(region)[100:]  # not page-aligned, as a view into a region can be
    assert populate_writable(view)
    assert region[:5] == b"kv..." and not any(region[5:])
    view.release()


def test_read_only_or_empty_views_are_left_alone() -> None:
    assert not populate_writable(memoryview(b"read-only bytes"))
    assert not populate_writable(memoryview(bytearray()))
