"""Holding back a waiting request whose uncached prefix another request is computing.

In-batch sharing (:class:`~hicache.scheduling.scheduler.PrefixScheduler`) only orders the
waiting queue: of several requests sharing a prefix nobody has cached, one goes first. A serving
loop that admits in that order while it has room would still start the others in the same round,
and each would compute the prefix again; so would a request that arrives while another one is
prefilling that prefix in chunks. A sequential oracle computes it once.

:class:`PrefixHold` is one admission round's view of what is being computed: a throwaway
simulated tree of the reusable prompts of the running requests still prefilling, to which the
loop adds each request it admits during the round. A waiting request is *held* (not admitted
this round) when that tree covers at least ``match_threshold`` tokens of its prompt past what the
real tree has cached for it: those pages are on their way, since a prefilling request commits
its pages chunk by chunk, and the held request hits them once they land.

Nothing carries over between rounds, which is what keeps a hold bounded: every round starts from
the requests running then. When the holder commits the shared pages, the held request's cached
prefix covers them; when the holder finishes, fails or is done with its prompt, it is no longer
in the tree. A prefilling request computes a chunk every step, so a hold lasts at most as long
as its holder's prefill, and ends with the held request's cached prefix longer or its holder
gone. With nothing running the tree starts empty, so the first waiting request that can start
is never held: the loop cannot deadlock on holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from hicache.errors import InvalidArgumentError
from hicache.keys import RadixKey
from hicache.radix import RadixCache, RadixCacheConfig
from hicache.scheduling.request import SchedulableRequest

__all__ = ["PrefixHold"]


class PrefixHold:
    """Which waiting requests to hold back this round; see the module docstring.

    ``tree`` is the real prefix tree (only peeked, never changed); ``computing`` the keys of the
    requests computing their prompts now. Feed :meth:`claim` every request admitted during the
    round, ask :meth:`holds` before admitting one. ``held`` collects the rids held so far.
    """

    def __init__(
        self, tree: RadixCache, match_threshold: int, computing: Iterable[RadixKey] = ()
    ) -> None:
        if type(match_threshold) is not int or match_threshold < 1:
            # 0 would hold a request on a prefix nobody computes any more of than it has.
            raise InvalidArgumentError(f"match_threshold must be an int >= 1: {match_threshold!r}")
        self._tree = tree
        self._threshold = match_threshold
        # Same page size as the real tree: only whole pages are ever committed and shared.
        self._sim = RadixCache(RadixCacheConfig(page_size=tree.page_size, simulated=True))
        self.held: set[Hashable] = set()
        for key in computing:
            self.claim(key)

    def claim(self, key: RadixKey) -> None:
        """A request that computes ``key`` past its cached prefix: running or just admitted.

        The whole key goes in: whatever of it is committed already is cached for the waiting
        requests too, so it cancels out in :meth:`holds`.
        """
        if not isinstance(key, RadixKey):
            raise InvalidArgumentError(f"expected a RadixKey, got {type(key).__name__}")
        if len(key):
            self._sim.insert(key)

    def holds(self, request: SchedulableRequest, cached: int | None = None) -> bool:
        """Whether the waiting ``request`` waits this round (its rid then joins ``held``).

        ``cached``: what the real tree holds of its key (device + host tokens), as the
        scheduler's plan matched it; peeked here when None, and only when some claimed request
        shares enough of the key for it to matter.
        """
        key = getattr(request, "key", None)
        if not isinstance(key, RadixKey):
            raise InvalidArgumentError(f"request {request!r} needs a RadixKey")
        if not len(key):
            return False
        coming, _ = self._sim.peek_prefix(key)
        if coming < self._threshold:
            return False
        if cached is None:  # device + host: neither is computed again
            cached = self._tree.peek_tiers(key).total
        if coming - cached < self._threshold:
            return False
        self.held.add(request.rid)
        return True
