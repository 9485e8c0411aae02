"""The RadixAttention prefix tree: what is cached, who holds it, what to evict."""

from hicache.radix.eviction import EvictionPolicy
from hicache.radix.node import TreeNode
from hicache.radix.pool_ledger import PoolLedger
from hicache.radix.shadow import ShadowInsertResult, ShadowMatchResult, ShadowRadixCache
from hicache.radix.tree import MatchResult, RadixCache, RadixCacheConfig

__all__ = [
    "EvictionPolicy",
    "MatchResult",
    "PoolLedger",
    "RadixCache",
    "RadixCacheConfig",
    "ShadowInsertResult",
    "ShadowMatchResult",
    "ShadowRadixCache",
    "TreeNode",
]
