"""Benchmarks of the stores: each backend's put/get against its raw client or plain I/O (the
``raw_*`` baselines), a crashed store's open time, and ``inspect``/``verify`` against a raw walk."""
