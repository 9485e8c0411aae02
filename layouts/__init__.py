"""KV memory layouts: shapes, offsets and conversions (``import hicache.layouts``)."""

from hicache.layouts.kinds import Layout

__all__ = ["Layout"]
