"""Summaries of a serving run: latency percentiles, throughput, hits per tier, and the oracle."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hicache.keys import RadixKey
from hicache.radix.tree import RadixCache, RadixCacheConfig
from hicache.serving.request import RequestRecord

__all__ = ["oracle_hit_rate", "print_table", "summarize"]


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(
    name: str, records: Sequence[RequestRecord], wall_s: float, metrics: dict[str, float]
) -> dict[str, Any]:
    """One configuration's row (times in ms)."""
    ok = [r for r in records if r.error is None and r.first_token_s is not None]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    tiers = ("hit_device", "hit_host", "hit_l3")
    device, host, l3 = (sum(getattr(r, f) for r in ok) for f in tiers)
    generated = sum(r.output_tokens for r in ok)
    return {
        "name": name,
        "requests": len(ok),
        "failed": len(records) - len(ok),
        "ttft_p50_ms": round(_percentile(ttft, 0.5), 2),
        "ttft_p90_ms": round(_percentile(ttft, 0.9), 2),
        "ttft_p99_ms": round(_percentile(ttft, 0.99), 2),
        "ttft_mean_ms": round(sum(ttft) / len(ttft), 2) if ttft else math.nan,
        "throughput_tok_s": round((prompt + generated) / wall_s, 1) if wall_s > 0 else 0.0,
        "hit_tokens_device": device,
        "hit_tokens_host": host,
        "hit_tokens_l3": l3,
        "prompt_tokens": prompt,
        "prefill_tokens_saved": device + host + l3,
        "hit_rate": round((device + host + l3) / prompt, 4) if prompt else 0.0,
        "wall_s": round(wall_s, 2),
        "bytes_device_to_host": int(metrics.get("bytes_device_to_host", 0)),
        "bytes_host_to_device": int(metrics.get("bytes_host_to_device", 0)),
        "bytes_host_to_l3": int(metrics.get("bytes_host_to_l3", 0)),
        "bytes_l3_to_host": int(metrics.get("bytes_l3_to_host", 0)),
        "bytes_staged": int(metrics.get("bytes_staged", 0)),
        "corrupt_pages": int(metrics.get("corrupt_pages", 0)),
        "errors": int(metrics.get("errors", 0)) + int(metrics.get("timeouts", 0)),
        "prefetch_skipped_slow": int(metrics.get("prefetch_skipped_slow", 0)),
    }


def oracle_hit_rate(prompts: Sequence[tuple[str | None, list[int], list[int]]], page: int) -> float:
    """The hit rate of an unbounded cache over ``(namespace, prompt, output)`` in arrival order:
    each prompt reuses its longest page-aligned cached prefix (never its last token)."""
    tree = RadixCache(RadixCacheConfig(page_size=page, simulated=True))
    hit = total = 0
    for namespace, prompt, output in prompts:
        total += len(prompt)
        if len(prompt) > 1:
            hit += tree.match_prefix(RadixKey(prompt[:-1], namespace)).prefix_len
        tree.insert(RadixKey(prompt + output[:-1], namespace))
    return round(hit / total, 4) if total else 0.0


_COLUMNS = [
    ("config", "name", "{:<15}"),
    ("TTFT p50", "ttft_p50_ms", "{:>10.1f}"),
    ("p90", "ttft_p90_ms", "{:>10.1f}"),
    ("p99", "ttft_p99_ms", "{:>10.1f}"),
    ("mean", "ttft_mean_ms", "{:>10.1f}"),
    ("tok/s", "throughput_tok_s", "{:>9.0f}"),
    ("hit dev", "hit_tokens_device", "{:>9d}"),
    ("hit host", "hit_tokens_host", "{:>9d}"),
    ("hit L3", "hit_tokens_l3", "{:>9d}"),
    ("hit rate", "hit_rate", "{:>9.3f}"),
    ("D->H MB", "bytes_device_to_host", "{:>9.1f}"),
    ("H->D MB", "bytes_host_to_device", "{:>9.1f}"),
    ("H->L3 MB", "bytes_host_to_l3", "{:>9.1f}"),
    ("L3->H MB", "bytes_l3_to_host", "{:>9.1f}"),
    ("corrupt", "corrupt_pages", "{:>8d}"),
    ("errors", "errors", "{:>7d}"),
]


def print_table(rows: Sequence[dict[str, Any]], out: Any) -> None:
    """A fixed-width table, one row per configuration (TTFT in ms, bytes in MB)."""
    widths = [len(fmt.format(0 if fmt.endswith("d}") else 0.0)) for _, _, fmt in _COLUMNS]
    titles = [title for title, _, _ in _COLUMNS]
    header = titles[0].ljust(widths[0]) + "".join(
        t.rjust(w) for t, w in zip(titles[1:], widths[1:], strict=True)
    )
    print(header, file=out)
    for row in rows:
        cells = []
        for _, key, fmt in _COLUMNS:
            value = row[key]
            if key.startswith("bytes_"):
                value = value / 1e6
            cells.append(fmt.format(value))
        print("".join(cells), file=out)
