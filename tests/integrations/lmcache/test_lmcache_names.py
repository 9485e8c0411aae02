"""LMCache key strings <-> hicache storage names: valid, reversible, one name per key."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "lmcache", reason="LMCache is installed only in the LMCache venv (.venv-lmcache)"
)

import torch
from lmcache.utils import CacheEngineKey

from hicache.integrations.lmcache.names import (
    KeyNames,
    escape_key,
    namespace_tag,
    unescape_key,
)
from hicache.keys import KEY_MAX_LEN, validate_key

ODD_KEYS = [
    "org/Model-1.5@1@0@-1a2b@bfloat16",
    "m@4@3@7fffffffffffffff@float16@lora%my_adapter@tenant%a/b",
    "..@..@_@__@%%",
    "-leading-dash",
    ".hidden",
    "spaces and\ttabs\nnewline",
    "naïve-ünïcödé-模型-🦙",
    "_41 is not an A",
    "",
]


@pytest.mark.parametrize("key", ODD_KEYS)
def test_escaped_key_round_trips_and_is_a_valid_storage_key(key: str) -> None:
    names = KeyNames("0123456789abcdef")
    name = names.name(key)
    assert validate_key(name) == name
    assert ".." not in name
    assert names.key_of(name) == key
    assert unescape_key(escape_key(key)) == key


def test_real_cache_engine_keys_come_back_equal() -> None:
    names = KeyNames(namespace_tag("KV_2LTD", ["bfloat16"], [(2, 2, 16, 16)]))
    key = CacheEngineKey(
        "meta-llama/Llama-3.1-8B",
        8,
        5,
        -0x1234ABCD,
        torch.bfloat16,
        request_configs={"lmcache.tag.user": "alice+x/y.z", "lmcache.tag.x": "1%2 3"},
    )
    back = names.key_of(names.name(key.to_string()))
    assert back == key.to_string()
    assert CacheEngineKey.from_string(back) == key


@pytest.mark.parametrize(
    "escaped",
    ["_41", "_2F", "_4", "a_", "_ff", "a.b", "a@b", "_c3"],
    ids=[
        "escaped-safe-char",
        "upper-hex",
        "short-escape",
        "dangling",
        "bad-utf8",
        "dot",
        "at",
        "cut-utf8",
    ],
)
def test_names_escaping_would_never_make_are_refused(escaped: str) -> None:
    assert unescape_key(escaped) is None


def test_distinct_keys_get_distinct_names() -> None:
    names = KeyNames("t")
    keys = ["a.b", "a_2eb", "a-b", "A-b", "a/b", "a@b", "a%b", "a b"]
    assert len({names.name(k) for k in keys}) == len(keys)


def test_a_key_too_long_to_escape_gets_a_valid_digest_name_that_is_not_listed() -> None:
    names = KeyNames("0123456789abcdef")
    key = "@" * KEY_MAX_LEN  # escapes to three times the limit
    name = names.name(key)
    assert validate_key(name) == name and len(name) <= KEY_MAX_LEN
    assert names.is_digest(name)
    assert names.key_of(name) is None
    assert names.name(key) == name
    assert names.name(key + "@") != name


def test_foreign_names_under_the_prefix_are_not_keys() -> None:
    names = KeyNames("0123456789abcdef")
    assert names.key_of("lmc-0123456789abcdef-kx_zz") is None
    assert names.key_of("lmc-fedcba9876543210-kabc") is None  # another namespace
    assert names.key_of("something-else") is None


def test_namespace_changes_with_format_dtype_and_shape() -> None:
    base = namespace_tag("KV_2LTD", ["bfloat16"], [(2, 2, 16, 16)])
    assert namespace_tag("KV_2LTD", ["bfloat16"], [(2, 2, 16, 16)]) == base
    others = {
        namespace_tag("KV_MLA_FMT", ["bfloat16"], [(2, 2, 16, 16)]),
        namespace_tag("KV_2LTD", ["float16"], [(2, 2, 16, 16)]),
        namespace_tag("KV_2LTD", ["bfloat16"], [(2, 2, 32, 16)]),
        namespace_tag("KV_2LTD", ["bfloat16", "bfloat16"], [(2, 2, 16, 16), (2, 2, 16, 16)]),
    }
    assert base not in others and len(others) == 4
