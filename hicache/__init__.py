"""hicache: hierarchical KV-cache storage."""
