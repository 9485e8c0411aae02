"""Memory pools: token-slot allocators and the request-to-token table."""

from hicache.pools.allocator import TokenSlotAllocator
from hicache.pools.req_to_token import ReqToTokenPool

__all__ = ["ReqToTokenPool", "TokenSlotAllocator"]
