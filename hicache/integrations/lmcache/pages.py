"""What an LMCache chunk looks like as a hicache page: the meta written and the meta expected.

The page header carries LMCache's memory format (as the pool name), the dtype and the shape,
so a reader whose engine has another format, dtype or shape gets a miss from the codec, never
bytes it would misread. A chunk with several KV groups (hybrid models) has one byte layout
per group; it is stored as flat ``uint8`` bytes, the groups' shapes and dtypes being covered by
the namespace (:func:`hicache.integrations.lmcache.names.namespace_tag`).

No LMCache import here: dtypes are anything whose ``str()`` is ``torch.<name>``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hicache.codec import PageMeta
from hicache.dtypes import DType
from hicache.errors import ConfigError
from hicache.integrations.lmcache.names import namespace_tag

__all__ = ["ChunkPages", "dtype_of"]

_POOL_CHARS = 16  # PageMeta.pool holds at most 16 ASCII characters


def dtype_of(torch_dtype: Any) -> DType:
    """The hicache dtype of a ``torch.dtype``; :class:`ConfigError` when it has none."""
    try:
        return DType.from_torch(torch_dtype)
    except ValueError as exc:
        raise ConfigError(f"the hicache page format has no dtype for {torch_dtype}") from exc


def _label(torch_dtype: Any) -> str:
    return str(torch_dtype).removeprefix("torch.")


class ChunkPages:
    """Page metas for the chunks of one LMCache engine (one format, dtypes and chunk shapes)."""

    def __init__(
        self, fmt: str, token_dim: int, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any]
    ) -> None:
        if not shapes or len(shapes) != len(dtypes):
            raise ConfigError(f"{len(shapes)} chunk shapes for {len(dtypes)} dtypes")
        self.fmt = fmt
        self.token_dim = token_dim
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self.dtypes = list(dtypes)
        self.tag = namespace_tag(fmt, [_label(d) for d in dtypes], self.shapes)
        self._metas: dict[tuple[Any, ...], PageMeta] = {}
        self.full = self.meta(fmt, self.shapes, self.dtypes)
        self.full_bytes = self.full.nbytes
        tokens = self.shapes[0][token_dim] if token_dim < len(self.shapes[0]) else 0
        self.token_bytes = self.full_bytes // tokens if tokens else 0

    def meta(self, fmt: str, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any]) -> PageMeta:
        """The meta of a chunk in ``fmt`` with these per-group shapes and dtypes."""
        cache_key = (fmt, tuple(tuple(s) for s in shapes), tuple(_label(d) for d in dtypes))
        meta = self._metas.get(cache_key)
        if meta is None:
            pool = fmt[:_POOL_CHARS]
            if len(shapes) == 1:
                meta = PageMeta(pool, dtype_of(dtypes[0]), tuple(int(d) for d in shapes[0]))
            else:
                nbytes = sum(
                    math.prod(s) * dtype_of(d).itemsize for s, d in zip(shapes, dtypes, strict=True)
                )
                meta = PageMeta(pool, DType.UINT8, (nbytes,))
            if len(self._metas) >= 1024:  # shapes vary only with the tokens of a last chunk
                self._metas.clear()
            self._metas[cache_key] = meta
        return meta

    def expected(self, payload_len: int) -> PageMeta:
        """The meta a stored payload of ``payload_len`` bytes must have to be read.

        A full chunk, or (one KV group only) a last chunk of fewer tokens, which LMCache stores
        with ``save_unfull_chunk``: its length says how many tokens. Any other length gets the
        full chunk's meta, so the codec names what is wrong with the page.
        """
        if (
            len(self.shapes) == 1
            and self.token_bytes
            and 0 < payload_len < self.full_bytes
            and payload_len % self.token_bytes == 0
        ):
            shape = list(self.shapes[0])
            shape[self.token_dim] = payload_len // self.token_bytes
            return self.meta(self.fmt, [shape], self.dtypes)
        return self.full
