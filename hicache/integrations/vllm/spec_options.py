"""The options of :class:`~hicache.integrations.vllm.spec.HiCacheOffloadingSpec`, checked.

vLLM hands an offloading spec the whole ``kv_connector_extra_config``: its own options (the host
tier's size, the eviction policy, ...) and the spec's. This module splits the two, refuses what
neither knows, and builds the ``secondary_tiers`` entry vLLM's tiering manager reads, so that
hicache's tier is made by vLLM's own tier factory.

No vLLM import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TIER_OPTIONS", "VLLM_OPTIONS", "tiering_extra_config"]

# What the spec passes on to HiCacheTier (which checks each value).
TIER_OPTIONS = frozenset(
    {"url", "n_read_threads", "n_write_threads", "io_timeout_s", "locality", "enable_kv_events"}
)
# What vLLM 0.32 and 0.33 read from the extra config of an offloading (tiering) spec.
VLLM_OPTIONS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "cpu_bytes_to_use",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "enable_telemetry",
        "eviction_policy",
        "cache_policy_module_path",
        "max_tracker_size",
        "offload_prompt_only",
        "self_describing_kv_events",
        "backpressure",
        "store_threshold",
        "sync_load_budget_bytes",
        "tier_poll_interval_s",
    }
)
_TIER_TYPE = {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm"}


def tiering_extra_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's extra config with the hicache options moved into one ``secondary_tiers`` entry.

    A ValueError names the first option that is unknown, missing or of the wrong kind: vLLM
    stops at start with it.
    """
    unknown = sorted(set(extra) - TIER_OPTIONS - VLLM_OPTIONS - {"secondary_tiers"})
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        raise ValueError(f"HiCacheOffloadingSpec has no option {names}")
    if "secondary_tiers" in extra:
        raise ValueError(
            "HiCacheOffloadingSpec option 'secondary_tiers' is not taken: the spec builds its "
            "tier from 'url' (use TieringOffloadingSpec to list tiers by hand)"
        )
    url = extra.get("url")
    if not isinstance(url, str) or not url:
        raise ValueError(
            "HiCacheOffloadingSpec option 'url' is required: a hicache backend URL such as "
            "'disk:///var/cache/hicache'"
        )
    size = extra.get("cpu_bytes_to_use")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(
            "HiCacheOffloadingSpec option 'cpu_bytes_to_use' must be an int > 0 (the host "
            f"tier's bytes), got {size!r}"
        )
    tier = dict(_TIER_TYPE)
    tier.update({k: v for k, v in extra.items() if k in TIER_OPTIONS})
    config = {k: v for k, v in extra.items() if k not in TIER_OPTIONS}
    config["secondary_tiers"] = [tier]
    return config
