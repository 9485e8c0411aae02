"""Summaries of a serving run: latency percentiles, throughput, hits per tier, and the oracle."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hicache.keys import RadixKey
from hicache.radix.tree import RadixCache, RadixCacheConfig
from hicache.serving.request import RequestRecord
from hicache.workloads.pool_report import state_snapshots

if TYPE_CHECKING:
    from hicache.serving.setup import ServingSetup

__all__ = ["config_row", "oracle_hit_rate", "print_table", "summarize", "ttft_by_round"]


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# The tiered cache's counters a row copies (as ints, 0 when absent), in the row's order: the
# bytes moved between tiers and the pages checked, then the L3 faults and lookups.
_MOVED_COUNTS = (
    "bytes_device_to_host",
    "bytes_host_to_device",
    "bytes_host_to_l3",
    "bytes_l3_to_host",
    "bytes_staged",
    "corrupt_pages",
    "l3_repaired_pages",
    "pages_checked_l3",
)
_L3_COUNTS = (
    "l3_read_failures",
    "l3_write_failures",
    "l3_unavailable",
    "prefetch_skipped_slow",
    "l3_lookup_pages",
    "l3_lookup_candidates",
)


def _counts(metrics: dict[str, float], names: Sequence[str]) -> dict[str, int]:
    return {name: int(metrics.get(name, 0)) for name in names}


def summarize(
    name: str, records: Sequence[RequestRecord], wall_s: float, metrics: dict[str, float]
) -> dict[str, Any]:
    """One configuration's row (times in ms), from its request records and the tiered cache's
    counters (``metrics``: :meth:`HiCacheMetrics.as_dict`, empty without a tiered cache).

    ``requests`` succeeded and ``failed`` did not; with none succeeded the TTFT figures are
    None (never NaN). Counters, copied as the cache counted them:

    - ``errors``: L3 backend calls that raised or ran past their deadline (calls, not pages);
    - ``l3_read_failures``: pages a prefetch could not read because a call failed or timed out;
    - ``l3_write_failures``: pages not written to L3 (the call failed, timed out or said no);
    - ``l3_unavailable``: 1 when an L3 was configured but could not be opened, so the run went
      on with L3 off;
    - ``corrupt_pages``: L3 pages that failed their checks and were treated as misses;
    - ``l3_repaired_pages``: L3 pages found bad, or listed but not delivered (a store that checks
      its own records, ``disk://``, reports a damaged one as a miss), by a read or a check
      before a write skipped them, and written again;
    - ``pages_checked_l3``: pages computed while L3 held them, whose copies were read back and
      checked before their write was skipped;
    - ``l3_lookup_pages`` of ``l3_lookup_candidates``: pages prefetches asked L3 about, of
      those they could have (a lookup ends after the first page L3 lacks);
    - ``held_requests``, ``held_rounds``: requests admission held back for a prefix another
      request was computing (:mod:`hicache.scheduling.prefix_hold`), and rounds they waited.
    """
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
        "ttft_p50_ms": _ms(_percentile(ttft, 0.5)),
        "ttft_p90_ms": _ms(_percentile(ttft, 0.9)),
        "ttft_p99_ms": _ms(_percentile(ttft, 0.99)),
        "ttft_mean_ms": _ms(sum(ttft) / len(ttft) if ttft else None),
        "throughput_tok_s": round((prompt + generated) / wall_s, 1) if wall_s > 0 else 0.0,
        "hit_tokens_device": device,
        "hit_tokens_host": host,
        "hit_tokens_l3": l3,
        "prompt_tokens": prompt,
        "prefill_tokens_saved": device + host + l3,
        "hit_rate": round((device + host + l3) / prompt, 4) if prompt else 0.0,
        "wall_s": round(wall_s, 2),
        **_counts(metrics, _MOVED_COUNTS),
        "errors": int(metrics.get("errors", 0)) + int(metrics.get("timeouts", 0)),
        **_counts(metrics, _L3_COUNTS),
        "held_requests": sum(1 for r in ok if r.held_rounds),
        "held_rounds": sum(r.held_rounds for r in ok),
    }


def oracle_hit_rate(
    prompts: Sequence[tuple[str | None, list[int], list[int]]],
    page: int,
    keep_interval: int | None = None,
) -> float:
    """The hit rate of an unbounded cache over ``(namespace, prompt, output)`` in arrival order:
    each prompt reuses its longest page-aligned cached prefix (never its last token).

    ``keep_interval``: for a model whose window or state pool keeps its data only at some ends
    (an SWA window, a Mamba snapshot), the same hit rule: a prefix is usable only up to an end
    where an earlier request left that data, as the engine leaves it (every ``keep_interval``
    tokens, at its reusable prompt's end, at its final end and where its prompt left what was
    cached, after what it hit).
    """
    tree = RadixCache(RadixCacheConfig(page_size=page, simulated=True))
    ends: set[tuple[str | None, int]] = set()  # (namespace, hash of the prefix) where data is
    hit = total = 0
    for namespace, prompt, output in prompts:
        total += len(prompt)
        reused = shared = 0
        if len(prompt) > 1:
            shared = reused = tree.match_prefix(RadixKey(prompt[:-1], namespace)).prefix_len
            if keep_interval is not None:
                reused = _usable_end(ends, namespace, prompt, shared, page)
        hit += reused
        cached = prompt + output[:-1]
        tree.insert(RadixKey(cached, namespace))
        if keep_interval is not None:
            points = _keep_points(len(prompt), len(cached), reused, page, keep_interval)
            for end in {*points, shared} - {0}:
                if end > reused:
                    ends.add((namespace, hash(tuple(cached[:end]))))
    return round(hit / total, 4) if total else 0.0


def _usable_end(
    ends: set[tuple[str | None, int]],
    namespace: str | None,
    prompt: list[int],
    shared: int,
    page: int,
) -> int:
    for end in range(shared - shared % page, 0, -page):
        if (namespace, hash(tuple(prompt[:end]))) in ends:
            return end
    return 0


def _keep_points(prompt_len: int, cached: int, after: int, page: int, interval: int) -> list[int]:
    final = cached // page * page
    points = {(prompt_len - 1) // page * page, final, *range(interval, final + 1, interval)}
    return [p for p in points if after < p <= final]


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
    ("L3 rd fail", "l3_read_failures", "{:>11d}"),
    ("L3 wr fail", "l3_write_failures", "{:>11d}"),
    ("L3 off", "l3_unavailable", "{:>7d}"),
]


def print_table(rows: Sequence[dict[str, Any]], out: Any) -> None:
    """A fixed-width table, one row per configuration (TTFT in ms, bytes in MB; ``-`` where a
    configuration had no figure, e.g. no TTFT when no request succeeded)."""
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
            if value is None:
                cells.append("-".rjust(len(fmt.format(0.0))))
                continue
            if key.startswith("bytes_"):
                value = value / 1e6
            cells.append(fmt.format(value))
        print("".join(cells), file=out)


def config_row(
    setup: ServingSetup,
    name: str,
    records: list[Any],
    wall: float,
    l3: dict[str, Any],
    sizes: dict[str, Any],
) -> dict[str, Any]:
    """One configuration's JSON row: the summary, TTFT per round and what each pool holds."""
    metrics = setup.cache.metrics.as_dict() if setup.cache is not None else {}
    # A wrapped L3 (--l3-bandwidth) reports its inner backend's counters as "inner.<name>".
    metrics["bytes_staged"] = float(
        sum(v for k, v in l3.items() if k.rsplit(".", 1)[-1] == "bytes_staged")
    )
    row = summarize(name, records, wall, metrics)
    row["rounds_ttft_ms"] = ttft_by_round(records)
    row["pool_bytes"] = sizes
    snapshots = state_snapshots(setup.engine.pools, sizes)
    if snapshots is not None:
        row["state_snapshots"] = snapshots
    return row


def ttft_by_round(records: list[Any]) -> list[float]:
    """Mean TTFT (ms) per chat round, from request ids ``<client>-r<round>``."""
    by_round: dict[int, list[float]] = {}
    for r in records:
        if r.ttft_s is not None and "-r" in r.rid:
            by_round.setdefault(int(r.rid.rsplit("-r", 1)[1]), []).append(r.ttft_s * 1000)
    return [round(sum(v) / len(v), 2) for _, v in sorted(by_round.items())]
