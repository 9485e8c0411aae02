"""Local service processes that tests and benchmarks start for themselves, on 127.0.0.1 only,
each stopped by its pid: nothing is left running when its ``with`` block ends.

- :mod:`.process`: free loopback ports and :class:`ManagedProcess`, the base of the others;
- :mod:`.moto`: a moto S3 server (``fsspec`` over ``s3://``);
- :mod:`.mooncake`: a ``mooncake_master``;
- :mod:`.redis`: ``redis-server`` processes (plain, TLS, cluster, sentinels).
"""
