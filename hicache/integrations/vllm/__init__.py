"""vLLM secondary KV tier: vLLM's offloaded chunks stored in any hicache backend.

vLLM builds the tier from its ``secondary_tiers`` config
(``{"type": "HiCacheTier", "module_path": "hicache.integrations.vllm", "url": ...}``). The tier
is :mod:`.tier`, its storage names :mod:`.names`.

The exported names are loaded on first use: :mod:`.tier` needs vLLM installed, and vLLM's
frontend process imports this package only to find the class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from hicache.integrations.vllm.tier import HiCacheTier

__all__ = ["HiCacheTier"]

__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, ".tier"))
