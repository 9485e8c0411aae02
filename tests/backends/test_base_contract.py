"""What the base class alone does for every backend, checked once, against the memory backend.

Key validation, batch shapes, buffer checks and closed-backend errors live in the public
methods of :class:`StorageBackend`, before a backend's ``_`` methods run. The conformance suite
checks that no backend overrides those methods (``test_public_api_is_the_base_classes``), so
these checks, moved here from the suite, hold for every backend without running per backend.
Also here: how a URL with a part its backend does not claim is refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine
from typing import Any, ClassVar

import numpy as np
import pytest

from hicache.backends.base import StorageBackend, UrlPart
from hicache.backends.memory import MemoryBackend, MemoryConfig
from hicache.backends.registry import BackendRegistry
from hicache.backends.testing import scan_all
from hicache.errors import BackendClosedError, ConfigError, InvalidArgumentError, InvalidKeyError

# (id, key): refused by every method. All but "" are refused as scan prefixes too.
BAD_KEYS: list[tuple[str, object]] = [
    ("slash", "/"),
    ("path", "a/b"),
    ("dotdot", ".."),
    ("inner-dotdot", "a..b"),
    ("empty", ""),
    ("too-long", "k" * 251),
    ("non-ascii", "é"),
    ("nul", "a\x00b"),
    ("leading-dot", ".hidden"),
    ("leading-dash", "-flag"),
    ("space", "a b"),
    ("int", 7),
    ("bytes", b"key"),
]


@pytest.fixture
async def backend() -> AsyncIterator[StorageBackend]:
    opened = await MemoryBackend.open(MemoryConfig(capacity_bytes=16 << 20))
    yield opened
    await opened.close()


# ----- batches ------------------------------------------------------------------------------
async def test_empty_batches(backend: StorageBackend) -> None:
    assert await backend.exists([]) == []
    assert await backend.get_into([], []) == []
    assert await backend.put([], []) == []
    assert await backend.delete([]) == []
    assert await backend.get([]) == []
    assert await backend.peek([], 8) == []
    assert await backend.leading_hits([]) == 0
    assert await scan_all(backend) == []


async def test_bad_batches_raise_and_store_nothing(backend: StorageBackend) -> None:
    bad_calls: list[Any] = [
        backend.get_into(["a", "b"], [bytearray(1)]),
        backend.put(["a", "b"], [b"x"]),
        backend.put(["a"], [b"x", b"y"]),
        backend.put(["a", "b", "a"], [b"1", b"2", b"3"]),  # a key twice in one put
        backend.put(["a", "b"], [b"x", "text"]),  # not a buffer
        backend.put(["a", "b"], [b"x", 12]),
        backend.leading_hits(["a"], batch_size=0),
        backend.peek(["a"], -1),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidArgumentError):
            await call
    assert await backend.exists(["a", "b"]) == [False, False]


async def test_single_str_instead_of_list_raises(backend: StorageBackend) -> None:
    calls: list[Any] = [
        backend.exists("abc"),
        backend.get_into("abc", [bytearray(1)] * 3),
        backend.put("abc", [b"x"] * 3),
        backend.delete("abc"),
        backend.leading_hits("abc"),
        backend.get("abc"),
        backend.peek("abc", 1),
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError):
            await call
    assert await backend.exists(["a", "b", "c", "abc"]) == [False] * 4


async def test_unusable_buffers_raise(backend: StorageBackend) -> None:
    assert await backend.put(["obj"], [b"x" * 100]) == [True]
    strided = np.zeros(200, dtype=np.uint8)[::2]  # a view with gaps
    read_only = [b"\0" * 100, memoryview(bytes(100)), [bytearray(50), bytes(50)]]
    for buffer in [*read_only, strided, "text", 5]:
        with pytest.raises(InvalidArgumentError):
            await backend.get_into(["obj"], [buffer])
    with pytest.raises(InvalidArgumentError):
        await backend.put(["strided"], [strided])
    assert await backend.exists(["strided"]) == [False]


@pytest.mark.parametrize("bad", [k for _, k in BAD_KEYS], ids=[i for i, _ in BAD_KEYS])
async def test_invalid_key_is_refused_everywhere(backend: StorageBackend, bad: Any) -> None:
    assert await backend.put(["good"], [b"kept"]) == [True]
    calls: list[Any] = [
        backend.exists(["good", bad]),
        backend.get_into(["good", bad], [bytearray(4), bytearray(4)]),
        backend.put(["fresh", bad], [b"new", b"new"]),
        backend.delete(["good", bad]),
        backend.leading_hits(["good", bad]),
        backend.get(["good", bad]),
        backend.peek(["good", bad], 4),
    ]
    if bad != "":  # "" is the prefix that matches everything
        calls.append(scan_all(backend, bad))
    for call in calls:
        with pytest.raises(InvalidKeyError):
            await call
    # Nothing of a batch with a bad key happened.
    assert await backend.exists(["good", "fresh"]) == [True, False]
    assert [i.key for i in await scan_all(backend)] == ["good"]


# ----- closing ------------------------------------------------------------------------------
async def test_calls_after_close_raise(backend: StorageBackend) -> None:
    assert await backend.put(["k"], [b"v"]) == [True]
    await backend.close()
    await backend.close()  # idempotent
    assert backend.closed
    calls: list[Coroutine[Any, Any, object]] = [
        backend.exists(["k"]),
        backend.get_into(["k"], [bytearray(1)]),
        backend.put(["k"], [b"w"]),
        backend.delete(["k"]),
        backend.leading_hits(["k"]),
        backend.get(["k"]),
        backend.peek(["k"], 1),
        scan_all(backend),
    ]
    for call in calls:
        with pytest.raises(BackendClosedError):
            await call


async def test_async_context_manager_closes(backend: StorageBackend) -> None:
    async with backend as entered:
        assert entered is backend
        assert await backend.put(["k"], [b"v"]) == [True]
    assert backend.closed
    with pytest.raises(BackendClosedError):
        await backend.exists(["k"])


async def test_stats_and_close_have_defaults() -> None:
    class Bare(StorageBackend):
        """Only the five data methods: ``_stats`` and ``_close`` come from the base."""

        name = "bare"

        async def _exists(self, keys: list[str]) -> list[bool]:
            return [False] * len(keys)

        async def _get_into(self, keys: list[str], buffers: list[list[memoryview]]) -> list[int]:
            return [-1] * len(keys)

        async def _put(self, keys: list[str], values: list[list[memoryview]]) -> list[bool]:
            return [False] * len(keys)

        async def _delete(self, keys: list[str]) -> list[bool]:
            return [False] * len(keys)

        async def _scan(self, prefix: str) -> AsyncIterator[Any]:
            return
            yield

    bare = Bare()
    assert await bare.put(["k"], [b"v"]) == [False]
    stats = await bare.stats()
    assert stats["put_failures"] == 1 and set(stats) == set(bare._counters)
    await bare.close()
    assert bare.closed


# ----- URL parts ------------------------------------------------------------------------------
class _Claims(MemoryBackend):
    """A memory backend that claims the URL parts a test names."""

    url_parts: ClassVar[frozenset[UrlPart]] = frozenset()


def _claiming(*parts: UrlPart) -> type[MemoryBackend]:
    return type("Claiming", (_Claims,), {"url_parts": frozenset(parts), "name": "claiming"})


@pytest.mark.parametrize(
    ("url", "part"),
    [
        ("memory://somehost", "host"),
        ("memory://somehost/x", "host"),
        ("memory:///x", "path"),
        ("memory://user:SECRET@h", "host"),
        ("memory://h:1234?capacity_bytes=1M", "host"),
    ],
)
def test_unclaimed_url_parts_are_refused_by_name(url: str, part: str) -> None:
    with pytest.raises(ConfigError, match=f"memory:// URLs take no {part}") as info:
        MemoryBackend.config_from_url(url, {})
    assert "SECRET" not in str(info.value)  # the user part of a host may hold credentials


def test_empty_location_parts_are_not_refused() -> None:
    for url in ("memory://", "memory:///", "memory://?capacity_bytes=1M", "memory:///?"):
        assert isinstance(MemoryBackend.config_from_url(url, {}), MemoryConfig), url


def test_claimed_parts_reach_url_location_fields() -> None:
    seen: list[tuple[str, str]] = []

    class Recording(_Claims):
        url_parts = frozenset({"host", "path"})

        @classmethod
        def url_location_fields(cls, netloc: str, path: str) -> dict[str, Any]:
            seen.append((netloc, path))
            return {}

    Recording.config_from_url("memory://h:1/a/b?capacity_bytes=1M", {})
    assert seen == [("h:1", "/a/b")]
    with pytest.raises(ConfigError, match="take no path"):
        _claiming("host").config_from_url("memory://h/a", {})
    with pytest.raises(ConfigError, match="take no host"):
        _claiming("path").config_from_url("memory://h/a", {})
    assert isinstance(_claiming("host").config_from_url("memory://h", {}), MemoryConfig)


@pytest.mark.parametrize("name", [e.name for e in BackendRegistry(group=None).entries()])
def test_every_builtin_refuses_the_parts_it_does_not_claim(name: str) -> None:
    cls = BackendRegistry(group=None).load(name)
    scheme = cls.url_schemes[0]
    for part, url in (("host", f"{scheme}://somehost"), ("path", f"{scheme}:///some/path")):
        if part not in cls.url_parts:
            with pytest.raises(ConfigError, match=f"take no {part}"):
                cls.config_from_url(url, {})
