"""The lookup half of ``hicache bench vllm``: a fresh process builds each side's tier in turn
(vLLM's fs tier first) over a store that another process filled, and asks vLLM's ``lookup`` for
every key the way vLLM's scheduler does (all keys, then ``on_schedule_end``, step after step)
until no answer is RETRY.

Timed, once each side's modules are imported: building the tier (opening the store), the steps
until every key is known, and then the scheduler thread's cost of a lookup whose answer is known
(the median of calls timed one by one).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

from hicache.tools.bench.engines.vllm_sides import Side, offload_keys

__all__ = ["fresh_lookup", "main"]

_STEP_SLEEP_S = 0.0005  # between steps, as a scheduler step would take at least
_TIMED_CALLS = 2000  # known lookups timed one by one (a clock read each side)
_CHILD_TIMEOUT_S = 600


def fresh_lookup(configs: dict[str, dict[str, Any]], keys_tag: int, count: int) -> dict[str, Any]:
    """Run the lookup child over each side in turn (``configs``: name -> tier config, in the
    order they run); {name: figures (seconds, microseconds)}."""
    request = json.dumps({"configs": configs, "tag": keys_tag, "count": count})
    code = "from hicache.tools.bench.engines.vllm_lookup import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", code, request],
        capture_output=True,
        text=True,
        timeout=_CHILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"the lookup process failed: {tail[0]}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    """The child: one JSON line of figures on stdout, a key per side."""
    # Imported before the clock starts: importing vLLM (~14 s here) is not what is timed.
    import vllm.v1.kv_offload.tiering.factory
    import vllm.v1.kv_offload.tiering.fs.manager
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401

    import hicache.integrations.vllm.tier  # noqa: F401
    from hicache.backends.registry import default_registry

    request = json.loads(sys.argv[1])
    keys = offload_keys(request["tag"], request["count"])
    figures = {}
    for name, config in request["configs"].items():
        if "url" in config:  # the backend's class and its modules, as for vLLM's tier
            default_registry.resolve_url(config["url"])
        figures[name] = _look_up(name, config, keys)
    print(json.dumps(figures))


def _look_up(name: str, config: dict[str, Any], keys: list[bytes]) -> dict[str, Any]:
    """One side: a new tier over the filled store, looked up step after step."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    started = time.perf_counter()
    side = Side(name, config, 4096, 8)
    built = time.perf_counter()
    ctx = ReqContext(req_id="bench-lookup")
    end = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
    steps = 0
    while True:
        results = [side.tier.lookup(k, ctx) for k in keys]
        steps += 1
        if LookupResult.RETRY not in results:
            break
        side.tier.on_schedule_end(end)
        time.sleep(_STEP_SLEEP_S)
    resolved = time.perf_counter()
    hits = sum(r is LookupResult.HIT for r in results)
    per_call = []
    clock, lookup = time.perf_counter, side.tier.lookup
    for k in keys[:_TIMED_CALLS]:
        t0 = clock()
        lookup(k, ctx)
        per_call.append((clock() - t0) * 1e6)
    side.close()
    return {
        "open_s": built - started,
        "resolve_s": resolved - built,
        "total_s": resolved - started,
        "steps": steps,
        "hits": hits,
        "known_lookup_us": statistics.median(per_call),
    }
