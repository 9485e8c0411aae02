"""HiCacheOffloadingSpec's options (no vLLM needed): vLLM's own pass through, hicache's become
one tier entry, and anything else stops the engine with a ValueError naming it."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.integrations.vllm.spec_options import tiering_extra_config

BASE = {
    "spec_name": "HiCacheOffloadingSpec",
    "spec_module_path": "hicache.integrations.vllm",
    "cpu_bytes_to_use": 1 << 30,
    "url": "disk:///var/cache/hicache",
}


def test_hicache_options_become_one_tier_and_vllms_stay() -> None:
    extra = dict(BASE, n_read_threads=2, eviction_policy="arc", block_size=64)
    config = tiering_extra_config(extra)
    assert config["secondary_tiers"] == [
        {
            "type": "HiCacheTier",
            "module_path": "hicache.integrations.vllm",
            "url": "disk:///var/cache/hicache",
            "n_read_threads": 2,
        }
    ]
    assert config["eviction_policy"] == "arc" and config["block_size"] == 64
    assert "url" not in config and "n_read_threads" not in config
    assert extra == dict(BASE, n_read_threads=2, eviction_policy="arc", block_size=64)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"n_raed_threads": 2}, "'n_raed_threads'"),
        ({"url": None}, "'url' is required"),
        ({"url": ""}, "'url' is required"),
        ({"cpu_bytes_to_use": None}, "'cpu_bytes_to_use'"),
        ({"cpu_bytes_to_use": "2GB"}, "'cpu_bytes_to_use'"),
        ({"cpu_bytes_to_use": True}, "'cpu_bytes_to_use'"),
        ({"cpu_bytes_to_use": -1}, "'cpu_bytes_to_use'"),
        ({"secondary_tiers": []}, "'secondary_tiers'"),
    ],
)
def test_a_bad_option_is_one_value_error_naming_it(change: dict[str, Any], named: str) -> None:
    extra = {k: v for k, v in dict(BASE, **change).items() if v is not None}
    with pytest.raises(ValueError, match=named):
        tiering_extra_config(extra)
