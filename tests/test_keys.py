"""Page keys: golden vectors pin the scheme; an independent re-implementation checks the spec."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.dtypes import DType
from hicache.errors import InvalidArgumentError, InvalidKeyError, InvalidTokenError
from hicache.keys import (
    KEY_MAX_LEN,
    PageKeyScheme,
    RadixKey,
    StorageFormat,
    ValidKey,
    chain_page_hashes,
    namespace_digest,
    storage_key,
    validate_key,
    validate_key_prefix,
)
from hicache.layouts import Layout

MODEL = "llama-3-8b"

# Frozen outputs of the version-1 scheme. If one of these changes, every stored page written
# before the change becomes unreachable: bump the domain strings instead of editing these.
GOLDEN_NS = "acac6cc79dbdcaf78a537f070b2efb2419c599dc2eea9e32fcebd9109adff17b"
GOLDEN_NS_TENANT = "51ed6ae143de514df1c800d9d5bfbdd6ef9bcec0a0ff2bec242463402966c9cd"
GOLDEN_NS_BIGRAM = "22c52fd2a65823f5657506365e7ecb33a214fd554022ad0ef3ac8678395eca48"
GOLDEN_PAGES = [
    "b47d5090095134f29c603170bd44290b85785adf22108bfbbafb66703585793d",
    "ffb31e198361a21578bc6e72861c186dfa5b2fffd110751c8959dde92f23663a",
]
GOLDEN_BIGRAM_PAGES = [
    "e22a8281b617942cf035e94a819d5893df4ac4b9fa3b50193530c26daf570c09",
    "2615f799ae482ae88ab4acf9299f74e397ba35a6e45d211414a35962af4d6889",
]
GOLDEN_FORMAT = "b0ec0c75fb8457dc"


def spec_namespace(model: str, extra: str | None, mode: str | None) -> bytes:
    """The namespace digest exactly as the module docstring specifies it."""
    h = hashlib.sha256(b"hicache-namespace-v1\x00")
    for part in (model, extra, mode):
        if part is None:
            h.update(b"\x00")
        else:
            raw = part.encode()
            h.update(b"\x01" + struct.pack("<Q", len(raw)) + raw)
    return h.digest()


def spec_chain(tokens: list[int], page: int, seed: bytes, bigram: bool = False) -> list[bytes]:
    units = [(tokens[i], tokens[i + 1]) for i in range(len(tokens) - 1)] if bigram else tokens
    out, prev = [], seed
    for p in range(len(units) // page):
        chunk = units[p * page : (p + 1) * page]
        flat = [t for pair in chunk for t in pair] if bigram else chunk
        prev = hashlib.sha256(prev + struct.pack(f"<{len(flat)}I", *flat)).digest()
        out.append(prev)
    return out


def test_golden_vectors() -> None:
    ns = namespace_digest(MODEL)
    assert ns.hex() == GOLDEN_NS
    assert namespace_digest(MODEL, "tenant-a").hex() == GOLDEN_NS_TENANT
    ns_bigram = namespace_digest(MODEL, None, is_bigram=True)
    assert ns_bigram.hex() == GOLDEN_NS_BIGRAM
    assert [h.hex() for h in chain_page_hashes(RadixKey(list(range(8))), 4, ns)] == GOLDEN_PAGES
    bigram = RadixKey(list(range(9)), is_bigram=True)
    assert [h.hex() for h in chain_page_hashes(bigram, 4, ns_bigram)] == GOLDEN_BIGRAM_PAGES
    fmt = StorageFormat(MODEL, DType.BFLOAT16, Layout.PAGE_FIRST, 4)
    assert fmt.digest == GOLDEN_FORMAT
    assert PageKeyScheme(fmt).storage_keys(RadixKey(list(range(8))))[0] == (
        f"{GOLDEN_NS[:16]}-{GOLDEN_FORMAT}-{GOLDEN_PAGES[0]}"
    )


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    page=st.integers(1, 9),
    extra=st.none() | st.text(max_size=5),
    bigram=st.booleans(),
)
def test_matches_the_written_spec(
    tokens: list[int], page: int, extra: str | None, bigram: bool
) -> None:
    seed = namespace_digest(MODEL, extra, bigram)
    assert seed == spec_namespace(MODEL, extra, "bigram" if bigram else None)
    key = RadixKey(tokens, extra, bigram)
    assert chain_page_hashes(key, page, seed) == spec_chain(tokens, page, seed, bigram)


def test_chain_continues_from_a_parent_hash() -> None:
    tokens = list(range(100, 132))
    seed = namespace_digest(MODEL)
    whole = chain_page_hashes(RadixKey(tokens), 8, seed)
    tail = chain_page_hashes(RadixKey(tokens[16:]), 8, whole[1])
    assert whole[2:] == tail


def test_partial_tail_page_is_ignored_and_prefixes_share_hashes() -> None:
    seed = namespace_digest(MODEL)
    a = chain_page_hashes(RadixKey(list(range(19))), 8, seed)
    b = chain_page_hashes(RadixKey([*range(16), 999, 998, 997, 996]), 8, seed)
    assert len(a) == 2 and a == b[:2]


def test_namespaces_never_share_pages() -> None:
    fmt = StorageFormat(MODEL, DType.BFLOAT16, Layout.PAGE_FIRST, 4)
    scheme = PageKeyScheme(fmt)
    tokens = list(range(16))
    keys = {
        extra: set(scheme.storage_keys(RadixKey(tokens, extra))) for extra in (None, "", "a", "b")
    }
    for x in keys:
        for y in keys:
            if x != y:
                assert not keys[x] & keys[y]


def test_every_format_field_changes_the_key() -> None:
    base = StorageFormat(MODEL, DType.BFLOAT16, Layout.PAGE_FIRST, 16, "kv", "tp0of2")
    variants = [
        StorageFormat("other-model", DType.BFLOAT16, Layout.PAGE_FIRST, 16, "kv", "tp0of2"),
        StorageFormat(MODEL, DType.FLOAT16, Layout.PAGE_FIRST, 16, "kv", "tp0of2"),
        StorageFormat(MODEL, DType.BFLOAT16, Layout.PAGE_FIRST_DIRECT, 16, "kv", "tp0of2"),
        StorageFormat(MODEL, DType.BFLOAT16, Layout.PAGE_FIRST, 32, "kv", "tp0of2"),
        StorageFormat(MODEL, DType.BFLOAT16, Layout.PAGE_FIRST, 16, "indexer", "tp0of2"),
        StorageFormat(MODEL, DType.BFLOAT16, Layout.PAGE_FIRST, 16, "kv", "tp1of2"),
    ]
    digests = {base.digest} | {v.digest for v in variants}
    assert len(digests) == 1 + len(variants)
    ns, page = namespace_digest(MODEL), bytes(32)
    assert storage_key(ns, base, page) != storage_key(ns, variants[0], page)


def test_storage_keys_are_valid_keys() -> None:
    fmt = StorageFormat(MODEL, DType.BFLOAT16, Layout.PAGE_FIRST, 2)
    for key in PageKeyScheme(fmt).storage_keys(RadixKey(list(range(64)), "tenant/../x")):
        assert validate_key(key) == key


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1.5], ["a"], [None]])
def test_bad_token_ids_raise(tokens: list[object]) -> None:
    seed = namespace_digest(MODEL)
    with pytest.raises(InvalidTokenError):
        chain_page_hashes(RadixKey(tokens), 1, seed)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokenError):
        RadixKey(tokens).validate()  # type: ignore[arg-type]


def test_bad_arguments_raise() -> None:
    seed = namespace_digest(MODEL)
    with pytest.raises(InvalidArgumentError):
        chain_page_hashes(RadixKey([1, 2]), 0, seed)
    with pytest.raises(InvalidArgumentError):
        chain_page_hashes(RadixKey([1, 2]), 1, b"short")
    with pytest.raises(InvalidArgumentError):
        namespace_digest("")
    with pytest.raises(InvalidArgumentError):
        StorageFormat(MODEL, DType.BFLOAT16, Layout.PAGE_FIRST, 0)
    with pytest.raises(InvalidArgumentError):
        StorageFormat(MODEL, DType.BFLOAT16, Layout.PAGE_FIRST, 16, pool="a/b")
    with pytest.raises(InvalidArgumentError):
        RadixKey([1], extra_key=5)  # type: ignore[arg-type]


def test_radix_key_units_slices_and_alignment() -> None:
    key = RadixKey([5, 6, 7, 8, 9], "ns")
    assert len(key) == 5 and key.page_aligned(2).token_ids == [5, 6, 7, 8]
    assert key.slice(1, 3) == RadixKey([6, 7], "ns")
    bigram = RadixKey([5, 6, 7, 8, 9], is_bigram=True)
    assert len(bigram) == 4
    assert list(bigram.units(0, 2)) == [(5, 6), (6, 7)]
    assert bigram.slice(1, 3).token_ids == [6, 7, 8]
    assert len(bigram.page_aligned(3)) == 3
    assert len(RadixKey([], is_bigram=True)) == 0


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "/",
        "a/b",
        "..",
        "a..b",
        "x" * (KEY_MAX_LEN + 1),
        "é",
        "a\x00b",
        ".hidden",
        "-flag",
        "a b",
        "a\n",
        "a\\b",
        5,
        b"abc",
        None,
    ],
)
def test_invalid_keys(bad: object) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key(bad)


def test_valid_keys_and_prefixes() -> None:
    for good in ("a", "A-b_c.d", "_x", "0" * KEY_MAX_LEN):
        assert validate_key(good) == good
    assert validate_key_prefix("") == ""
    assert validate_key_prefix("abc-") == "abc-"
    for bad in ("/", "..", ".a", "-a", "é"):
        with pytest.raises(InvalidKeyError):
            validate_key_prefix(bad)


def test_valid_keys_are_checked_once() -> None:
    fmt = StorageFormat("m", DType.BFLOAT16, Layout.PAGE_FIRST, 4)
    made = storage_key(bytes(32), fmt, bytes(range(32)))
    assert type(made) is ValidKey and validate_key(made) is made  # no second regex
    checked = validate_key("plain-key_1.x")
    assert type(checked) is ValidKey and checked == "plain-key_1.x"
    assert validate_key(checked) is checked
    with pytest.raises(InvalidKeyError):
        validate_key("../escape")
