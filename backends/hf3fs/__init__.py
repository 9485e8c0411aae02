"""``3fs://`` (or ``hf3fs://``): fixed-size slots in one data file per rank on a 3FS mount.

Modules: ``backend`` (the backend and its config), ``slots`` (which key is in which slot, the
free list and LRU), ``index`` (on-disk formats: slot headers and the index log), ``posix`` (the
data file and its POSIX I/O engine) and ``usrbio`` (the engine over 3FS's USRBIO client, which
is imported only when a backend opens in that mode).
"""

from hicache.backends.hf3fs.backend import Hf3fsBackend, Hf3fsConfig, Hf3fsMode

__all__ = ["Hf3fsBackend", "Hf3fsConfig", "Hf3fsMode"]
