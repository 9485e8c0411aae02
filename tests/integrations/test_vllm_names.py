"""Storage names of the vLLM tier (no vLLM needed: names.py reads the config by attribute)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hicache.integrations.vllm.names import StorageNames, format_fields
from hicache.keys import KEY_MAX_LEN, ValidKey, validate_key


def config(**parallel: int) -> SimpleNamespace:
    sizes = {"tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "rank": 0, **parallel}
    return SimpleNamespace(
        model=SimpleNamespace(name="org/model", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=4),
        replicated_layout=False,
        parallel=SimpleNamespace(**sizes),
    )


def test_names_are_valid_keys_built_without_a_second_check() -> None:
    names = StorageNames(format_fields(config(), 65536, "cpu"))
    for key in (bytes(36), b"\xff" * 36, b"k"):
        name = names.name(key)
        assert type(name) is ValidKey and validate_key(str(name)) == name
        assert name == names.prefix + key.hex()


def test_a_key_too_long_for_its_hex_is_hashed() -> None:
    names = StorageNames(format_fields(config(), 4096, "cpu"))
    long_key = b"\x01" * KEY_MAX_LEN
    name = names.name(long_key)
    assert len(name) <= KEY_MAX_LEN and name.startswith(names.prefix + "h")
    assert validate_key(str(name)) == name
    assert name != names.name(b"\x02" * KEY_MAX_LEN)


@pytest.mark.parametrize(
    ("fields", "chunk"),
    [({"tp_size": 2}, 65536), ({"rank": 1}, 65536), ({}, 32768)],
)
def test_another_format_is_another_prefix(fields: dict[str, int], chunk: int) -> None:
    base = StorageNames(format_fields(config(), 65536, "cpu"))
    other = StorageNames(format_fields(config(**fields), chunk, "cpu"))
    assert base.prefix != other.prefix
    assert base.name(b"key") != other.name(b"key")


def test_another_device_or_kv_layout_is_another_prefix() -> None:
    cpu = StorageNames(format_fields(config(), 65536, "cpu"))
    assert cpu.prefix != StorageNames(format_fields(config(), 65536, "cuda")).prefix
    laid_out = config()
    laid_out.kv_cache_layout = "NHD"
    assert cpu.prefix != StorageNames(format_fields(laid_out, 65536, "cpu")).prefix
