"""The backend tests: one folder per backend (``disk_backend/``, ``file_backend/``, ...), the
tests of ``backends/``'s own modules (base, registry, wrappers, memory) here. Loading this file
puts this folder on ``sys.path``, so every folder's tests import the shared kits here
(``disk_kit``, ``file_kit``, ``shm_kit``, ``memory_kit``, ``hf3fs_kit``)."""
