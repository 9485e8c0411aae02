"""Radix keys, chained page hashes and storage keys.

The scheme (pinned by golden vectors in ``tests/test_keys.py``):

- A namespace digest ``ns = SHA256("hicache-namespace-v1\\0" || part(model_id) || part(extra_key)
  || part(mode))`` where ``part(None) = 0x00`` and ``part(s) = 0x01 || len(utf8(s)) as u64 LE ||
  utf8(s)``; ``mode`` is ``"bigram"`` for EAGLE bigram keys and None otherwise.
- Page ``i`` of a key hashes as ``h_i = SHA256(h_{i-1} || page_bytes_i)`` with ``h_{-1} = ns``.
  ``page_bytes`` is the page's token ids as little-endian uint32; in bigram mode each unit is the
  pair ``(t_j, t_{j+1})`` packed as two uint32.
- A storage key is ``"{ns[:8].hex()}-{format_digest}-{h_i.hex()}"``: the namespace tag lets tools
  list one namespace by prefix, and the format digest covers everything that changes the stored
  bytes (model, dtype, layout, page size, pool, shard), so a reader with another format can
  never hit a page it would misread.

SHA-256 and not a fast non-cryptographic hash: a tenant must not be able to craft token
sequences whose pages collide with another tenant's.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache.dtypes import DType, Layout
from hicache.errors import InvalidArgumentError, InvalidKeyError, InvalidTokenError

__all__ = [
    "HASH_BYTES",
    "KEY_MAX_LEN",
    "PageKeyScheme",
    "RadixKey",
    "StorageFormat",
    "ValidKey",
    "chain_packed_hashes",
    "chain_page_hashes",
    "namespace_digest",
    "namespace_tag",
    "pack_token_ids",
    "storage_key",
    "validate_key",
    "validate_key_prefix",
]

HASH_BYTES = 32
KEY_MAX_LEN = 250
_NAMESPACE_DOMAIN = b"hicache-namespace-v1\x00"
_FORMAT_DOMAIN = "hicache-format-v1"
# One letter or digit first (a leading '.' marks temporary files, a leading '-' reads as a flag),
# then letters, digits, '.', '_' and '-'. '..' is refused separately so no key is a path step.
_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]*\Z")
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}\Z")


class ValidKey(str):
    """A string known to be a valid storage key: :func:`storage_key` makes them (valid by
    construction) and :func:`validate_key` returns them, so checking one again, in a backend or
    in each wrapper around it, is a type check instead of a regex."""

    __slots__ = ()


def validate_key(key: object) -> ValidKey:
    """Return ``key`` as a :class:`ValidKey` if it is a valid storage key, else raise
    :class:`InvalidKeyError`."""
    if type(key) is ValidKey:
        return key
    if not isinstance(key, str):
        raise InvalidKeyError(f"a key must be a str, not {type(key).__name__}")
    if not key or len(key) > KEY_MAX_LEN:
        raise InvalidKeyError(f"a key must have 1 to {KEY_MAX_LEN} characters, got {len(key)}")
    if _KEY_RE.match(key) is None or ".." in key:
        raise InvalidKeyError(
            f"invalid key {key!r}: use ASCII letters, digits, '.', '_' and '-', "
            "start with a letter, digit or '_', and never '..'"
        )
    return ValidKey(key)


def validate_key_prefix(prefix: object) -> str:
    """Return ``prefix`` if it can start a valid key ('' matches everything)."""
    if not isinstance(prefix, str):
        raise InvalidKeyError(f"a key prefix must be a str, not {type(prefix).__name__}")
    if len(prefix) > KEY_MAX_LEN or _PREFIX_RE.match(prefix) is None or ".." in prefix:
        raise InvalidKeyError(f"invalid key prefix {prefix!r}")
    if prefix[:1] in (".", "-"):
        raise InvalidKeyError(f"invalid key prefix {prefix!r}: keys never start with . or -")
    return prefix


def _validate_name(what: str, value: str) -> str:
    if not isinstance(value, str) or _NAME_RE.match(value) is None or ".." in value:
        raise InvalidArgumentError(f"invalid {what} {value!r}: 1-64 of [A-Za-z0-9._-]")
    return value


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; raises :class:`InvalidTokenError`."""
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise InvalidTokenError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every mainstream platform has 4-byte 'I'
        packed = array("L", token_ids)
    if not _LITTLE_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


_LITTLE_ENDIAN = array("I", [1]).tobytes()[0] == 1


class RadixKey:
    """Token ids plus the namespace they live in.

    ``extra_key`` is the namespace (LoRA id, tenant, cache salt): keys with different
    ``extra_key`` never share cached pages. With ``is_bigram`` (EAGLE) each unit is the pair
    ``(t_i, t_{i+1})``, so a key of n tokens has n - 1 units. Lengths, slices and page alignment
    count units.
    """

    __slots__ = ("extra_key", "is_bigram", "token_ids")

    def __init__(
        self,
        token_ids: Sequence[int],
        extra_key: str | None = None,
        is_bigram: bool = False,
    ) -> None:
        if extra_key is not None and not isinstance(extra_key, str):
            raise InvalidArgumentError("extra_key must be a str or None")
        self.token_ids = token_ids
        self.extra_key = extra_key
        self.is_bigram = is_bigram

    def __len__(self) -> int:
        n = len(self.token_ids)
        return max(n - 1, 0) if self.is_bigram else n

    def __repr__(self) -> str:
        head = list(self.token_ids[:8])
        more = "..." if len(self.token_ids) > 8 else ""
        return f"RadixKey({head}{more}, extra_key={self.extra_key!r}, is_bigram={self.is_bigram})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RadixKey):
            return NotImplemented
        return (
            self.extra_key == other.extra_key
            and self.is_bigram == other.is_bigram
            and list(self.token_ids) == list(other.token_ids)
        )

    def __hash__(self) -> int:
        return hash((tuple(self.token_ids), self.extra_key, self.is_bigram))

    def units(self, start: int = 0, stop: int | None = None) -> Sequence[int | tuple[int, int]]:
        """The units in ``[start, stop)``: tokens, or token pairs in bigram mode."""
        stop = len(self) if stop is None else stop
        if not self.is_bigram:
            return self.token_ids[start:stop]
        t = self.token_ids
        return [(t[i], t[i + 1]) for i in range(start, stop)]

    def slice(self, start: int, stop: int | None = None) -> RadixKey:
        """The key of units ``[start, stop)`` in the same namespace."""
        stop = len(self) if stop is None else min(stop, len(self))
        start = min(max(start, 0), stop)
        extra = 1 if self.is_bigram and stop > start else 0
        return RadixKey(self.token_ids[start : stop + extra], self.extra_key, self.is_bigram)

    def page_aligned(self, page_size: int) -> RadixKey:
        """The longest prefix made of whole pages."""
        if page_size <= 0:
            raise InvalidArgumentError(f"page_size must be positive, got {page_size}")
        n = len(self)
        return self if n % page_size == 0 else self.slice(0, n - n % page_size)

    def validate(self) -> RadixKey:
        """Raise :class:`InvalidTokenError` unless every token id fits in uint32."""
        pack_token_ids(self.token_ids)
        return self


def namespace_digest(model_id: str, extra_key: str | None = None, is_bigram: bool = False) -> bytes:
    """The 32-byte seed of every page chain in one namespace of one model."""
    if not isinstance(model_id, str) or not model_id:
        raise InvalidArgumentError("model_id must be a non-empty str")
    h = hashlib.sha256(_NAMESPACE_DOMAIN)
    for part in (model_id, extra_key, "bigram" if is_bigram else None):
        if part is None:
            h.update(b"\x00")
        else:
            raw = part.encode("utf-8")
            h.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    return h.digest()


def _unit_bytes(key: RadixKey, n_units: int) -> memoryview:
    """Packed bytes of the first ``n_units`` units: 4 bytes a token, 8 a bigram pair."""
    if not key.is_bigram:
        return memoryview(pack_token_ids(key.token_ids[:n_units]))
    packed = pack_token_ids(key.token_ids[: n_units + 1])
    pairs = bytearray(8 * n_units)
    # Interleave t[0..n) and t[1..n] as 4-byte lanes: pairs = t0 t1 t1 t2 t2 t3 ...
    pairs_view = memoryview(pairs).cast("I")
    src = memoryview(packed).cast("I")
    pairs_view[0::2] = src[:n_units]
    pairs_view[1::2] = src[1 : n_units + 1]
    return memoryview(pairs)


def chain_page_hashes(
    key: RadixKey, page_size: int, seed: bytes, max_pages: int | None = None
) -> list[bytes]:
    """Chained SHA-256 hashes of every whole page of ``key`` (a trailing partial page is ignored).

    ``seed`` is the namespace digest for a chain that starts at the key's first token, or the
    hash of the page just before ``key`` when hashing continues an existing chain.
    """
    if page_size <= 0:
        raise InvalidArgumentError(f"page_size must be positive, got {page_size}")
    if len(seed) != HASH_BYTES:
        raise InvalidArgumentError(f"a chain seed is {HASH_BYTES} bytes, got {len(seed)}")
    n_pages = len(key) // page_size
    if max_pages is not None:
        n_pages = min(n_pages, max_pages)
    if n_pages == 0:
        return []
    data = _unit_bytes(key, n_pages * page_size)
    step = len(data) // n_pages
    sha256 = hashlib.sha256
    out: list[bytes] = []
    prev = seed
    for off in range(0, n_pages * step, step):
        h = sha256(prev)
        h.update(data[off : off + step])
        prev = h.digest()
        out.append(prev)
    return out


def chain_packed_hashes(packed: bytes | memoryview, page_bytes: int, seed: bytes) -> list[bytes]:
    """:func:`chain_page_hashes` over units already packed (as a radix node keeps them).

    ``packed`` holds whole pages of ``page_bytes`` each, in the packing of ``_unit_bytes``.
    """
    if page_bytes <= 0 or len(packed) % page_bytes:
        raise InvalidArgumentError(f"{len(packed)} bytes are not whole {page_bytes}-byte pages")
    if len(seed) != HASH_BYTES:
        raise InvalidArgumentError(f"a chain seed is {HASH_BYTES} bytes, got {len(seed)}")
    view = memoryview(packed)
    sha256 = hashlib.sha256
    out: list[bytes] = []
    prev = seed
    for off in range(0, len(view), page_bytes):
        h = sha256(prev)
        h.update(view[off : off + page_bytes])
        prev = h.digest()
        out.append(prev)
    return out


@dataclass(frozen=True, slots=True)
class StorageFormat:
    """Everything that changes a stored page's bytes; two formats never share keys."""

    model_id: str
    dtype: DType
    layout: Layout
    page_size: int
    pool: str = "kv"
    shard: str = "replicated"
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise InvalidArgumentError("model_id must be a non-empty str")
        if not isinstance(self.dtype, DType) or not isinstance(self.layout, Layout):
            raise InvalidArgumentError("dtype must be a DType and layout a Layout")
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise InvalidArgumentError(f"page_size must be a positive int, got {self.page_size}")
        _validate_name("pool", self.pool)
        _validate_name("shard", self.shard)
        text = "\x00".join(
            (
                _FORMAT_DOMAIN,
                self.model_id,
                self.dtype.label,
                self.layout.label,
                str(self.page_size),
                self.pool,
                self.shard,
            )
        )
        object.__setattr__(self, "digest", hashlib.sha256(text.encode()).hexdigest()[:16])


def namespace_tag(namespace: bytes) -> str:
    """What every storage key of the namespace ``namespace`` (its digest) starts with, before
    the first dash: 16 hex digits."""
    return namespace[:8].hex()


def storage_key(namespace: bytes, fmt: StorageFormat, page_hash: bytes) -> ValidKey:
    """The backend key of one page: namespace tag, format digest, page hash (hex digits and
    dashes only, 98 characters: valid by construction)."""
    if len(page_hash) != HASH_BYTES or len(namespace) != HASH_BYTES:
        raise InvalidArgumentError("namespace and page hash must be 32-byte digests")
    return ValidKey(f"{namespace_tag(namespace)}-{fmt.digest}-{page_hash.hex()}")


class PageKeyScheme:
    """Page hashes and storage keys of one model's pages in one storage format."""

    __slots__ = ("_seeds", "fmt")

    def __init__(self, fmt: StorageFormat) -> None:
        self.fmt = fmt
        self._seeds: dict[tuple[str | None, bool], bytes] = {}

    def namespace(self, extra_key: str | None, is_bigram: bool = False) -> bytes:
        seed = self._seeds.get((extra_key, is_bigram))
        if seed is None:
            seed = namespace_digest(self.fmt.model_id, extra_key, is_bigram)
            self._seeds[(extra_key, is_bigram)] = seed
        return seed

    def page_hashes(self, key: RadixKey) -> list[bytes]:
        """Chained hashes of the whole pages of ``key``, from its first token."""
        seed = self.namespace(key.extra_key, key.is_bigram)
        return chain_page_hashes(key, self.fmt.page_size, seed)

    def storage_keys(self, key: RadixKey) -> list[str]:
        """Backend keys of the whole pages of ``key``, from its first token."""
        ns = self.namespace(key.extra_key, key.is_bigram)
        return [storage_key(ns, self.fmt, h) for h in self.page_hashes(key)]

    def keys_for_hashes(
        self, hashes: Sequence[bytes], extra_key: str | None = None, is_bigram: bool = False
    ) -> list[str]:
        """Backend keys for page hashes already computed (for example kept in a tree node)."""
        ns = self.namespace(extra_key, is_bigram)
        return [storage_key(ns, self.fmt, h) for h in hashes]
