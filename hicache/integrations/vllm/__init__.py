"""vLLM's offloaded KV chunks stored in any hicache backend.

Two ways in: the offloading spec :mod:`.spec` (``"spec_name": "HiCacheOffloadingSpec"``, with
``url`` and ``cpu_bytes_to_use``), which runs on vLLM's CPU build too; or the secondary tier alone,
in vLLM's own tiering spec (``secondary_tiers``:
``{"type": "HiCacheTier", "module_path": "hicache.integrations.vllm", "url": ...}``). The tier is
:mod:`.tier`, its storage names :mod:`.names`.

The exported names are loaded on first use: :mod:`.tier` needs vLLM installed, and vLLM's
frontend process imports this package only to find the class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from hicache.integrations.vllm.spec import HiCacheOffloadingSpec
    from hicache.integrations.vllm.tier import HiCacheTier

__all__ = ["HiCacheOffloadingSpec", "HiCacheTier"]

__getattr__ = lazy_getattr(__name__, {"HiCacheOffloadingSpec": ".spec", "HiCacheTier": ".tier"})
