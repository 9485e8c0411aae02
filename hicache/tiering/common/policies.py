"""The tiering policies as enums, and the pure rules that decide with them.

Nothing here holds state: the controller and HiRadixCache ask these functions, so each rule is
tested on its own and reads the same everywhere it is used.
"""

from __future__ import annotations

import enum

from hicache.errors import InvalidArgumentError

__all__ = [
    "L3Admission",
    "PrefetchStopPolicy",
    "TerminationReason",
    "WindowAdmission",
    "WritePolicy",
    "backup_on_hit",
    "can_terminate",
    "prefetch_timeout",
    "admit_to_l3",
    "admit_window",
]


class WritePolicy(enum.Enum):
    """When device pages are backed up to host memory."""

    WRITE_THROUGH = "write_through"  # on first insert
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # once a node's hits reach a threshold
    WRITE_BACK = "write_back"  # only when the device evicts it


class PrefetchStopPolicy(enum.Enum):
    """When a request waiting on an L3 prefetch may be scheduled."""

    BEST_EFFORT = "best_effort"  # at once, with whatever has arrived
    WAIT_COMPLETE = "wait_complete"  # only once every read has finished
    TIMEOUT = "timeout"  # once done, or once the prefetch's timeout has passed


class L3Admission(enum.Enum):
    """Which host pages are also written to L3."""

    ALL = "all"  # every page backed up to host
    HIT_THRESHOLD = "hit_threshold"  # pages of nodes hit at least the L3 threshold


class WindowAdmission(enum.Enum):
    """Which windows of a window pool (SWA) are written to L3, beside the anchor's pages."""

    REUSED = "reused"  # a node's window once a request reused the node (hit it)
    ALL = "all"  # every window backed up to host (revisits after long absences hit L3)


class TerminationReason(enum.Enum):
    """Why a prefetch ended; a metric per reason."""

    COMPLETE = "complete"  # every page that L3 had arrived
    BEST_EFFORT = "best_effort"  # stopped when the request was scheduled
    TIMEOUT = "timeout"  # stopped by the timeout rule
    ABORTED = "aborted"  # the request went away
    BELOW_THRESHOLD = "below_threshold"  # L3 held too little to be worth reading
    NO_HOST_MEMORY = "no_host_memory"  # no host pages could be had for it
    ERROR = "error"  # the backend failed


def prefetch_timeout(base_s: float, per_1k_tokens_s: float, max_s: float, tokens: int) -> float:
    """``min(max, base + per_1k_tokens * tokens / 1024)``: the timeout policy's deadline."""
    if tokens < 0 or base_s < 0 or per_1k_tokens_s < 0 or max_s < 0:
        raise InvalidArgumentError("prefetch timeout terms must be non-negative")
    return min(max_s, base_s + per_1k_tokens_s * tokens / 1024)


def backup_on_hit(policy: WritePolicy, hit_count: int, threshold: int) -> bool:
    """Whether a device node hit ``hit_count`` times is backed up to host now."""
    if policy is WritePolicy.WRITE_THROUGH:
        return True
    if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
        return hit_count >= threshold
    return False  # write_back: only on eviction


def admit_to_l3(admission: L3Admission, hit_count: int, threshold: int) -> bool:
    """Whether a page on host is written to L3 now."""
    return admission is L3Admission.ALL or hit_count >= threshold


def admit_window(admission: WindowAdmission, hit_count: int) -> bool:
    """Whether a node's window (on host) is written to L3 now."""
    return admission is WindowAdmission.ALL or hit_count >= 1


def can_terminate(
    policy: PrefetchStopPolicy, done: bool, elapsed_s: float, timeout_s: float
) -> TerminationReason | None:
    """Whether a running prefetch may stop now so its request is scheduled, and why.

    ``None``: keep waiting. A finished prefetch is always complete, whatever the policy.
    """
    if done:
        return TerminationReason.COMPLETE
    if policy is PrefetchStopPolicy.BEST_EFFORT:
        return TerminationReason.BEST_EFFORT
    if policy is PrefetchStopPolicy.TIMEOUT and elapsed_s >= timeout_s:
        return TerminationReason.TIMEOUT
    return None
