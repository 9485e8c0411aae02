"""``nixl://``: objects moved by NIXL to files (POSIX plugin) or S3 (OBJ plugin).

Modules: ``backend`` (the backend and its config), ``agent`` (the NIXL agent, its plugins and
registered memory), ``stores`` (where objects live: files or S3 keys) and ``transfer`` (staging
and batched transfers). NIXL itself is imported when a backend opens, not when this package is
imported.
"""

from hicache.backends.nixl.backend import NixlBackend, NixlConfig, NixlPlugin, PosixQueue

__all__ = ["NixlBackend", "NixlConfig", "NixlPlugin", "PosixQueue"]
