"""What a stored SGLang page is: shard identity, key prefix and page kind (sglang.pools).

SGLang's page keys name no model, rank or layout, so the prefix a PoolBinding adds must: two
ranks, layouts or dtypes must never share a key, and the same configuration must always find
its own pages again. Engine objects are duck-typed, so plain fakes stand in for them here.
"""

from __future__ import annotations

import enum
import string
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.dtypes import DType
from hicache.errors import ConfigError, InvalidKeyError
from hicache.integrations.sglang.pools import PoolBinding, ShardIdentity
from hicache.keys import validate_key
from hicache.layouts import Layout

HEX_KEY = "0123456789abcdef" * 4


# ----- fakes --------------------------------------------------------------------------------
def _config(**changes: Any) -> SimpleNamespace:
    """The fields of SGLang's HiCacheStorageConfig the adapter reads."""
    fields: dict[str, Any] = {
        "model_name": "org/tiny",
        "tp_rank": 0,
        "tp_size": 2,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "dcp_rank": 0,
        "dcp_size": 1,
        "is_mla_model": False,
        "is_storage_writer": True,
    }
    fields.update(changes)
    return SimpleNamespace(**fields)


def _shard(**changes: Any) -> ShardIdentity:
    return ShardIdentity.from_storage_config(_config(**changes))


class FakeHostPool:
    """A host pool with K and V apart, pages as views of ``kv_buffer`` (as SGLang's MHA pool).

    ``page_tokens`` is how many token slots a page view spans; it defaults to ``page_size``
    and is set apart only to change the page size without changing the page's shape.
    """

    def __init__(
        self,
        page_size: int = 4,
        layout: str = "page_first",
        dtype: torch.dtype = torch.bfloat16,
        heads: int = 2,
        head_dim: int = 8,
        slots: int = 32,
        storage_format_tag: str | None = None,
        page_tokens: int | None = None,
    ) -> None:
        self.page_size = page_size
        self.layout = layout
        self.storage_format_tag = storage_format_tag
        self.page_tokens = page_tokens or page_size
        self.kv_buffer = torch.zeros(2, slots, heads, head_dim, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = False) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + self.page_tokens]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, flat: torch.Tensor) -> None:
        page = self.kv_buffer[:, index : index + self.page_tokens]
        page.copy_(flat.reshape(page.shape))


class CopyingHostPool(FakeHostPool):
    """A pool whose page is assembled fresh on each call (as SGLang's Mamba pool does)."""

    def get_data_page(self, index: int, flat: bool = False) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + self.page_tokens]
        fresh = torch.cat([page[0:1], page[1:2]])  # a new tensor, not a view
        return fresh.flatten() if flat else fresh


class ViewlessHostPool(FakeHostPool):
    """A pool that has no page view for this layout (SGLang raises ValueError)."""

    def __init__(self, error: Exception, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error = error

    def get_data_page(self, index: int, flat: bool = False) -> torch.Tensor:
        raise self.error


def _binding(name: str = "kv", shard: ShardIdentity | None = None, **pool: Any) -> PoolBinding:
    return PoolBinding(name, FakeHostPool(**pool), shard or _shard())


# ----- ShardIdentity ------------------------------------------------------------------------
def test_shard_reads_the_storage_config() -> None:
    shard = _shard(tp_rank=1, pp_rank=1, pp_size=2, attn_cp_rank=1, attn_cp_size=2)
    assert (shard.model, shard.tp_rank, shard.tp_size) == ("org/tiny", 1, 2)
    assert (shard.pp_rank, shard.pp_size, shard.cp_rank, shard.cp_size) == (1, 2, 1, 2)
    assert (shard.rank_replicated, shard.storage_writer) == (False, True)


def test_shard_defaults_for_fields_older_configs_lack() -> None:
    config = _config(model_name=None)
    for field in ("dcp_rank", "dcp_size", "is_storage_writer"):
        delattr(config, field)
    shard = ShardIdentity.from_storage_config(config)
    assert (shard.model, shard.dcp_rank, shard.dcp_size, shard.storage_writer) == ("", 0, 1, True)


@pytest.mark.parametrize("pool", ["kv", "dsa", "mamba"])
def test_sharded_pools_differ_across_tp_ranks(pool: str) -> None:
    labels = {_shard(tp_rank=rank, tp_size=4).label(pool) for rank in range(4)}
    assert len(labels) == 4


@pytest.mark.parametrize("pool", ["kv", "dsa", "swa"])
def test_replicated_pools_are_shared_across_tp_ranks(pool: str) -> None:
    labels = {_shard(tp_rank=rank, tp_size=4, is_mla_model=True).label(pool) for rank in range(4)}
    assert len(labels) == 1


def test_mamba_state_is_tp_sharded_even_in_a_replicated_model() -> None:
    labels = {
        _shard(tp_rank=rank, tp_size=4, is_mla_model=True).label("mamba") for rank in range(4)
    }
    assert len(labels) == 4


def test_replicated_label_still_tells_sizes_and_other_ranks_apart() -> None:
    base = {"is_mla_model": True, "tp_size": 4, "dcp_size": 2, "pp_size": 2, "attn_cp_size": 2}
    variants = [
        {},
        {"tp_size": 8},
        {"dcp_rank": 1},
        {"pp_rank": 1},
        {"attn_cp_rank": 1},
        {"is_mla_model": False},
    ]
    labels = [_shard(**{**base, **change}).label("kv") for change in variants]
    assert len(set(labels)) == len(variants)


@pytest.mark.parametrize(
    ("mla", "writer", "pool", "writes"),
    [
        (False, True, "kv", True),
        (False, False, "kv", True),  # sharded state: every rank writes its own
        (True, True, "kv", True),
        (True, False, "kv", False),  # replicated state: only the storage writer writes
        (True, False, "mamba", True),  # TP-sharded even in an MLA model
    ],
)
def test_writes(mla: bool, writer: bool, pool: str, writes: bool) -> None:
    shard = _shard(is_mla_model=mla, is_storage_writer=writer)
    assert shard.writes(pool) is writes
    assert _binding(pool, shard).writes is writes


# ----- PoolBinding: the page kind -----------------------------------------------------------
def test_binding_describes_the_page() -> None:
    binding = _binding("kv", page_size=4, layout="layer_first", dtype=torch.float16)
    assert binding.name == "kv" and binding.page_size == 4
    assert binding.meta.pool == "kv"
    assert binding.meta.dtype is DType.FLOAT16
    assert binding.meta.shape == (2, 4, 2, 8)
    assert binding.meta.layout is Layout.LAYER_FIRST


def test_an_unknown_layout_is_stored_as_raw() -> None:
    assert _binding(layout="page_head").meta.layout is Layout.RAW


def test_an_enum_pool_name_binds_by_its_value() -> None:
    class PoolName(str, enum.Enum):
        KV = "kv"

    by_enum = PoolBinding(PoolName.KV, FakeHostPool(), _shard())
    assert by_enum.name == "kv"
    assert by_enum.prefix == _binding("kv").prefix


def test_a_view_aliases_the_pool_and_a_fresh_tensor_does_not() -> None:
    shard = _shard()
    assert PoolBinding("kv", FakeHostPool(), shard).aliases_pool is True
    assert PoolBinding("mamba", CopyingHostPool(), shard).aliases_pool is False


def test_page_view_and_store_flat_reach_the_pool() -> None:
    pool = FakeHostPool()
    binding = PoolBinding("kv", pool, _shard())
    page = torch.arange(2 * 4 * 2 * 8, dtype=torch.float32).to(torch.bfloat16)
    binding.store_flat(8, page)
    # The page landed at token slots 8..11 of both K and V, and nowhere else.
    assert torch.equal(binding.page_view(8).flatten(), page)
    assert torch.count_nonzero(pool.kv_buffer[:, :8]) == 0
    assert torch.count_nonzero(pool.kv_buffer[:, 12:]) == 0
    binding.page_view(8).zero_()  # a view: writing it writes the pool
    assert torch.count_nonzero(pool.kv_buffer) == 0


@pytest.mark.parametrize(
    "error", [ValueError("Unsupported layout: page_head"), NotImplementedError()]
)
def test_a_pool_without_page_views_is_a_config_error_naming_it(error: Exception) -> None:
    pool = ViewlessHostPool(error, layout="page_head")
    with pytest.raises(ConfigError, match="'indexer'") as caught:
        PoolBinding("indexer", pool, _shard())
    assert caught.value.__cause__ is error


# ----- PoolBinding: the key prefix ----------------------------------------------------------
# Each changes one thing a stored page's bytes depend on; each must get a prefix of its own.
PREFIX_VARIANTS: dict[str, Callable[[], PoolBinding]] = {
    "baseline": lambda: _binding(),
    "model": lambda: _binding(shard=_shard(model_name="org/other")),
    "tp rank": lambda: _binding(shard=_shard(tp_rank=1)),
    "tp size": lambda: _binding(shard=_shard(tp_size=4)),
    "pp rank": lambda: _binding(shard=_shard(pp_rank=1, pp_size=2)),
    "pool": lambda: _binding("dsa"),
    "layout": lambda: _binding(layout="page_first_direct"),
    "page size only": lambda: _binding(page_size=8, page_tokens=4),
    "dtype, same bytes": lambda: _binding(dtype=torch.float16),
    "shape, same bytes": lambda: _binding(heads=4, head_dim=4),
    "storage format tag": lambda: _binding(storage_format_tag="fp8-scales-v2"),
}


def test_every_difference_gets_its_own_prefix() -> None:
    prefixes = {name: make().prefix for name, make in PREFIX_VARIANTS.items()}
    assert len(set(prefixes.values())) == len(prefixes), prefixes


@pytest.mark.parametrize("name", sorted(PREFIX_VARIANTS))
def test_the_same_configuration_gets_the_same_prefix(name: str) -> None:
    # Another process binding the same pool must find the pages this one wrote.
    assert PREFIX_VARIANTS[name]().prefix == PREFIX_VARIANTS[name]().prefix


def test_the_prefix_ignores_what_does_not_change_a_page() -> None:
    # The pool's size and contents are not part of a page's kind.
    small, large = _binding(slots=16), _binding(slots=64)
    large.host_pool.kv_buffer.fill_(1)
    assert small.prefix == large.prefix


def test_replicated_pools_share_a_prefix_across_tp_ranks_but_mamba_does_not() -> None:
    ranks = [_shard(tp_rank=rank, is_mla_model=True) for rank in range(2)]
    kv = {PoolBinding("kv", FakeHostPool(), shard).prefix for shard in ranks}
    mamba = {PoolBinding("mamba", CopyingHostPool(), shard).prefix for shard in ranks}
    assert (len(kv), len(mamba)) == (1, 2)


# ----- PoolBinding.key ----------------------------------------------------------------------
def test_key_accepts_sglang_hex_keys() -> None:
    binding = _binding()
    key = binding.key(HEX_KEY)
    assert key == binding.prefix + HEX_KEY
    assert validate_key(key) == key


def test_key_accepts_160_characters() -> None:
    binding = _binding()
    assert validate_key(binding.key("a" * 160)).endswith("a" * 160)


@pytest.mark.parametrize(
    "engine_key",
    ["", "..", "a/b", "../x", "a..b", ".hidden", "-flag", "a b", "abc\n", "é", "a" * 161],
)
def test_key_refuses_malformed_strings(engine_key: str) -> None:
    with pytest.raises(InvalidKeyError):
        _binding().key(engine_key)


@pytest.mark.parametrize("engine_key", [None, 12, b"abc", ["abc"]])
def test_key_refuses_non_strings(engine_key: object) -> None:
    with pytest.raises(InvalidKeyError):
        _binding().key(engine_key)


_KEY_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
_KEY_TEXT = st.one_of(
    st.text(alphabet=st.sampled_from("af09_.-"), min_size=1, max_size=12),  # mostly good
    st.text(alphabet=st.sampled_from("af09_"), min_size=155, max_size=165),  # at the limit
    st.text(alphabet=st.sampled_from("ab09_.-/ \n\\:é"), max_size=40),  # mostly bad
    st.text(max_size=20),  # anything
)
_BINDING = _binding()  # one binding for every example: building one per example is waste


def _engine_key_ok(engine_key: str) -> bool:
    """The rule for SGLang keys, spelled out: 1-160 key characters, no leading '.' or '-'
    (hidden files, flags) and no '..' (a path step)."""
    return (
        1 <= len(engine_key) <= 160
        and engine_key[0] not in ".-"
        and set(engine_key) <= _KEY_CHARS
        and ".." not in engine_key
    )


@settings(max_examples=300, deadline=None)
@given(_KEY_TEXT)
def test_key_accepts_exactly_the_rule_and_makes_valid_keys(engine_key: str) -> None:
    if not _engine_key_ok(engine_key):
        with pytest.raises(InvalidKeyError):
            _BINDING.key(engine_key)
        return
    key = _BINDING.key(engine_key)
    assert validate_key(key) == key  # every key it makes is a valid storage key
    assert key == _BINDING.prefix + engine_key  # the engine's key is kept whole
