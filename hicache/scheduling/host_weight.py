"""How much a prefix cached on host is worth to scheduling and routing, against one on the device.

A host hit needs no computing, but its pages are copied host -> device before the request's
forward uses them; a device hit costs nothing. LPM, DFS_WEIGHT, in-batch sharing and the
cache-aware router therefore value a cached prefix as ``device + host_hit_weight * host`` tokens,
where the weight is the share of recomputing a token that loading it instead saves:
``1 - load_cost / recompute_cost``, in [0, 1]. 1 counts a host hit as a device hit (SGLang's
LPM does: ``device prefix + host_hit_length``); 0 ignores the host tier.

The default, 0.8, comes from both sides of that ratio:

* bandwidth against compute: loading a token moves its KV over PCIe (Llama-3-8B: 32 layers x 8
  KV heads x 128 x 2 x 2 bytes = 128 KiB; at about 50 GB/s host -> device, about 2.6 us), while
  recomputing it costs its prefill FLOPs (2 x 8e9 = 16 GFLOP; at about 400 TFLOP/s sustained,
  about 40 us): loading costs about 7 % of recomputing, a weight of about 0.93;
* measured end to end (SGLang issue #26305, MiniMax-M2.7, see docs/DESIGN.md): time to first
  token with the prefix on host was 482 ms against 1725 ms recomputing it at 8K tokens, 1027
  against 5118 ms at 128K; those times include the suffix's compute and queueing, so loading
  costs at most 28 % (8K) and 20 % (128K) of recomputing: a weight of at least 0.72 to 0.8.

0.8 is the measured bound rounded, below the bandwidth estimate because the copies compete with
other requests' loads and backups for the same link.
"""

from __future__ import annotations

import math

from hicache.errors import ConfigError

__all__ = ["DEFAULT_HOST_HIT_WEIGHT", "check_host_hit_weight"]

DEFAULT_HOST_HIT_WEIGHT = 0.8


def check_host_hit_weight(value: object, name: str = "host_hit_weight") -> None:
    """Raise ConfigError unless ``value`` is a number in [0, 1] (NaN is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
