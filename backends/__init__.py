"""Storage backends.

The contract is :mod:`.base` (with the buffer helpers of :mod:`.segments`); :mod:`.registry`
turns names and URLs into backends; :mod:`.testing` is the conformance suite. ``memory`` is one
module; a backend of several modules is a subpackage whose ``__init__`` exports the backend and
its config: ``file``, ``shm``, ``fsspec``, ``mooncake``, ``nixl``, ``hf3fs``. Wrappers (faults,
latency, a thread of its own) are in :mod:`.wrappers`.
"""
