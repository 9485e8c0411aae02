"""Benchmarks that serve requests end to end: HiSparse decode at a fixed device budget, and
workers behind each router over HTTP."""
