"""Write the burst replay trace: ``python -m hicache.tools.burst_trace OUT.jsonl``.

The trace is :func:`~hicache.workloads.synthetic.burst_conversations_trace` (long multi-turn
conversations, every turn present); measure it with
``hicache serve --compare --json --trace OUT.jsonl --rate 0`` so every turn arrives at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hicache.tools.cli_parsing import int_range, output_file
from hicache.workloads.synthetic import BURST_CHAT, burst_conversations_trace
from hicache.workloads.traces import dump_trace

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache.tools.burst_trace", description=__doc__)
    p.add_argument("out", type=output_file, help="the JSONL file to write")
    p.add_argument("--conversations", type=int_range(1, 100_000), default=BURST_CHAT.clients)
    p.add_argument("--turns", type=int_range(1, 1000), default=BURST_CHAT.rounds)
    p.add_argument("--seed", type=int_range(0, 1 << 32), default=BURST_CHAT.seed)
    p.add_argument("--vocab", type=int_range(1, 1 << 32), default=BURST_CHAT.vocab)
    args = p.parse_args(argv)
    config = dataclasses.replace(
        BURST_CHAT, clients=args.conversations, rounds=args.turns, seed=args.seed, vocab=args.vocab
    )
    requests = burst_conversations_trace(config)
    dump_trace(requests, args.out)
    tokens = sum(len(r.tokens) for r in requests)
    print(f"{len(requests)} requests, {tokens} prompt tokens -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
