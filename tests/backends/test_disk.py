"""The ``disk`` backend: the conformance suite, its formats and its faults."""

from __future__ import annotations

import pathlib

from hicache.backends.disk import DiskBackend, DiskConfig
from hicache.backends.testing import BackendConformanceTests


class TestDiskConformance(BackendConformanceTests):
    async def open_backend(self, location: pathlib.Path) -> DiskBackend:
        return await DiskBackend.open(DiskConfig(root=str(location), segment_bytes=4 << 20))
