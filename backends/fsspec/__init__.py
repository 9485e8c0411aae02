"""``s3://``, ``gs://``, ``az://`` and ``fsspec+proto://``: objects in an fsspec filesystem.

Modules: ``backend`` (the backend and its URLs), ``config`` (its options and the protocol sets)
and ``ops`` (the per-protocol calls and the mapping of their errors). ``import fsspec`` inside
this package is an absolute import: it is the fsspec library, never this package. Client
libraries other than fsspec (s3fs, gcsfs, adlfs) are imported by fsspec when a filesystem of
their protocol is first made, not here.
"""

from hicache.backends.fsspec.backend import FsspecBackend
from hicache.backends.fsspec.config import FsspecConfig

__all__ = ["FsspecBackend", "FsspecConfig"]
