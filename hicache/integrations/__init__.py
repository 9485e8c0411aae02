"""Adapters that let other serving engines store KV pages in hicache backends."""
