"""The storage tier (L3): pages between host memory and a storage backend. Page identity and
codec calls (``bundler.py``), the write queue and prefetch reads on asyncio tasks
(``storage_tier.py``, with its task supervisor, failure log, repair of bad copies and host
memory registration), which nodes go to L3 (``writer.py``), running prefetches
(``prefetcher.py``) and hanging their pages under the tree (``prefetch_insert.py``). It imports
``common/`` and ``host/`` (host pages to write from and read into), never the cache above.
"""
