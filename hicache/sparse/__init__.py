"""HiSparse: sparse-attention decode from a per-request device hot buffer over host KV."""
