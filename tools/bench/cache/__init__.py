"""Benchmarks of the cache's parts, each in isolation: the page codec, layout conversions and
copies, the I/O kernel, the radix tree, and the controller's overhead and L3 round trip."""
