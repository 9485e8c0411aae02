"""``mooncake://host:port``: objects in a Mooncake distributed store (see :mod:`.backend`).

Modules: ``backend`` (the backend and its config), ``client`` (one store client: setup,
registered memory, batched moves), ``connection`` (the clients shared by backends with the same
settings), ``gate`` (living through a master outage: backoff, probes, quiet logs) and ``admin``
(listing through the master's HTTP admin server). The
Mooncake library itself is imported when a backend connects, not when this package is imported.
"""

from hicache.backends.mooncake.backend import MooncakeBackend, MooncakeConfig

__all__ = ["MooncakeBackend", "MooncakeConfig"]
