"""What a stored SGLang page is: its key in the backend and the kind of page behind it.

SGLang's page keys are chained SHA-256 hashes of token ids: they name no model, rank or layout.
A :class:`PoolBinding` ties one registered host pool to a key prefix that does: a digest of the
model, the shard this rank holds, the pool, the host layout, the page size, the dtype and the
page's shape. Two ranks, layouts or dtypes never share a key, so a page written in one format
is a miss in another (the codec's header checks the same again on every read).

Engine objects are duck-typed here (``host_pool.get_data_page`` and friends, the fields of
``HiCacheStorageConfig``) so this module imports nothing from SGLang.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from hicache.codec import PageMeta
from hicache.dtypes import DType
from hicache.errors import ConfigError, InvalidKeyError
from hicache.integrations.page_runs import contiguous_runs, runs_within, uint8_dtype
from hicache.layouts import Layout

__all__ = ["KEY_DOMAIN", "PoolBinding", "ShardIdentity"]

KEY_DOMAIN = "hicache-sglang-v1"
# SGLang's own keys are hex digests; a few more characters are let through for backends that
# derive keys of their own, never a path separator or anything a shell or URL would read.
_ENGINE_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,159}\Z")
# Pools whose state is split across TP ranks even in a model whose KV is rank-replicated.
_TP_SHARDED_POOLS = frozenset({"mamba"})
_LAYOUTS = {
    "layer_first": Layout.LAYER_FIRST,
    "page_first": Layout.PAGE_FIRST,
    "page_first_direct": Layout.PAGE_FIRST_DIRECT,
}


@dataclass(frozen=True, slots=True)
class ShardIdentity:
    """Which slice of the model's cached state this rank holds, from ``HiCacheStorageConfig``."""

    model: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dcp_rank: int
    dcp_size: int
    rank_replicated: bool  # MLA-like KV: every TP rank holds the same bytes
    storage_writer: bool  # for replicated state, only one rank per DCP shard writes

    @classmethod
    def from_storage_config(cls, config: Any) -> ShardIdentity:
        return cls(
            model=str(config.model_name or ""),
            tp_rank=int(config.tp_rank),
            tp_size=int(config.tp_size),
            pp_rank=int(config.pp_rank),
            pp_size=int(config.pp_size),
            cp_rank=int(config.attn_cp_rank),
            cp_size=int(config.attn_cp_size),
            dcp_rank=int(getattr(config, "dcp_rank", 0)),
            dcp_size=int(getattr(config, "dcp_size", 1)),
            rank_replicated=bool(config.is_mla_model),
            storage_writer=bool(getattr(config, "is_storage_writer", True)),
        )

    def replicated(self, pool: str) -> bool:
        return self.rank_replicated and pool not in _TP_SHARDED_POOLS

    def label(self, pool: str) -> str:
        """The shard part of a pool's namespace: ranks that hold different bytes differ."""
        if self.replicated(pool):
            tp = f"rep-tp{self.tp_size}-dcp{self.dcp_rank}of{self.dcp_size}"
        else:
            tp = f"tp{self.tp_rank}of{self.tp_size}"
        return f"{tp}-pp{self.pp_rank}of{self.pp_size}-cp{self.cp_rank}of{self.cp_size}"

    def writes(self, pool: str) -> bool:
        """Whether this rank writes the pool's pages (replicated state has one writer)."""
        return self.storage_writer or not self.replicated(pool)


class PoolBinding:
    """One registered host pool: its key prefix, its page kind and how pages are reached."""

    __slots__ = (
        "_base_address",
        "aliases_pool",
        "buffer_bytes",
        "host_pool",
        "meta",
        "name",
        "page_size",
        "prefix",
        "writes",
    )

    def __init__(self, name: str, host_pool: Any, shard: ShardIdentity) -> None:
        self.name = str(getattr(name, "value", name))
        self.host_pool = host_pool
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        layout = str(getattr(host_pool, "layout", "raw"))
        try:
            sample = host_pool.get_data_page(0, flat=False)
        except (ValueError, NotImplementedError) as exc:
            raise ConfigError(
                f"SGLang host pool {self.name!r} (layout {layout!r}) has no page view the "
                f"hicache adapter can store: {exc}"
            ) from exc
        try:
            dtype = DType.from_torch(sample.dtype)
        except ValueError as exc:
            raise ConfigError(f"SGLang host pool {self.name!r}: {exc}") from exc
        self.meta = PageMeta(
            pool=self.name[:16],
            dtype=dtype,
            shape=tuple(int(d) for d in sample.shape),
            layout=_LAYOUTS.get(layout, Layout.RAW),
        )
        # A pool whose page "view" is a fresh tensor (Mamba concatenates its state tensors)
        # is read into a staging page and set through the pool; a real view is read in place.
        # A view gives the same memory every time it is asked for; two live fresh tensors
        # never do.
        again = host_pool.get_data_page(0, flat=False)
        self.aliases_pool = _address(sample) == _address(again)
        self.writes = shard.writes(self.name)
        self.prefix = f"sgl-{self._digest(shard, layout)}-"
        # The pool's whole buffer as bytes, once: a page's runs are then slices of it, and it
        # is what a backend taking registered memory registers.
        buffer: Any = getattr(host_pool, "kv_buffer", None)
        self.buffer_bytes: memoryview | None = None
        self._base_address = 0
        if buffer is not None and buffer.is_contiguous() and buffer.device.type == "cpu":
            self.buffer_bytes = memoryview(buffer.view(-1).view(uint8_dtype()).numpy())
            self._base_address = int(buffer.data_ptr())

    def _digest(self, shard: ShardIdentity, layout: str) -> str:
        fields = (
            KEY_DOMAIN,
            shard.model,
            shard.label(self.name),
            self.name,
            layout,
            str(self.page_size),
            self.meta.dtype.label,
            "x".join(map(str, self.meta.shape)),
            str(getattr(self.host_pool, "storage_format_tag", None) or ""),
        )
        return hashlib.sha256("\x00".join(fields).encode()).hexdigest()[:20]

    def key(self, engine_key: object) -> str:
        """The backend key of one of SGLang's page keys; :class:`InvalidKeyError` if malformed."""
        if (
            not isinstance(engine_key, str)
            or _ENGINE_KEY_RE.match(engine_key) is None
            or ".." in engine_key
        ):
            raise InvalidKeyError(f"not an SGLang page key: {engine_key!r:.80}")
        return self.prefix + engine_key

    def page_view(self, host_index: int) -> Any:
        """The pool's page that starts at token slot ``host_index``, as SGLang lays it out."""
        return self.host_pool.get_data_page(host_index, flat=False)

    def runs(self, page: Any) -> list[memoryview]:
        """A page view's contiguous runs (see :mod:`hicache.integrations.page_runs`)."""
        if self.buffer_bytes is not None:
            runs = runs_within(self.buffer_bytes, self._base_address, page)
            if runs is not None:
                return runs
        return contiguous_runs(page)

    def store_flat(self, host_index: int, flat_page: Any) -> None:
        """Put a page read into a staging tensor into the pool (pools that do not alias)."""
        self.host_pool.set_from_flat_data_page(host_index, flat_page)


def _address(tensor: Any) -> int:
    offset = int(tensor.storage_offset()) * int(tensor.element_size())
    return int(tensor.untyped_storage().data_ptr()) + offset
