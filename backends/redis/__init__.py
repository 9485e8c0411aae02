"""``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``: pages in Redis or Valkey.

Modules: ``backend`` (the backend: batches, failures, listing), ``config`` (the URL's options
and credentials), ``client`` (the redis-py asyncio client for a server, a cluster or a
Sentinel-watched master, and the pipelines a batch runs as), ``pages`` (how page GETs and SETs
run), ``direct`` and ``resp`` (hicache's own connections for them, reading replies into the
caller's buffers). ``import redis`` inside this
package is an absolute import: it is the redis-py library, never this package.
"""

from hicache.backends.redis.backend import RedisBackend
from hicache.backends.redis.config import RedisConfig

__all__ = ["RedisBackend", "RedisConfig"]
