"""The ``mooncake`` backend's listing, through the master's HTTP admin server, and helpers.

Mooncake's client cannot list keys; the master's admin server (``--metrics_port``) answers
``/get_all_keys`` (one key a line) and ``/batch_query_keys?keys=a,b`` (sizes, as JSON).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from hicache.errors import BackendUnavailableError

__all__ = ["MARKER", "list_objects"]

# Suffix of the one-byte marker that stands for an empty object ("#" is outside the key alphabet).
MARKER = "#empty"
_QUERY_KEYS = 64  # keys per size query: keeps the URL short


def list_objects(admin_url: str, prefix: str) -> list[tuple[str, int]]:
    """(Mooncake key, size) of every object under ``prefix``, markers turned into size 0."""
    text = _http_get(admin_url, "/get_all_keys").decode()
    names = [k for k in text.splitlines() if k.startswith(prefix)]
    plain = [k for k in names if "#" not in k[len(prefix) :]]
    empty = {k[: -len(MARKER)] for k in names if k.endswith(MARKER)}
    sizes = _sizes(admin_url, plain)
    out = list(sizes.items())
    out += [(k, 0) for k in sorted(empty - sizes.keys()) if "#" not in k[len(prefix) :]]
    return out


def _sizes(admin_url: str, mkeys: list[str]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for lo in range(0, len(mkeys), _QUERY_KEYS):
        chunk = mkeys[lo : lo + _QUERY_KEYS]
        query = urllib.parse.urlencode({"keys": ",".join(chunk)}, safe=",")
        body = json.loads(_http_get(admin_url, f"/batch_query_keys?{query}"))
        for key, entry in (body.get("data") or {}).items():
            values = entry.get("values") if entry.get("ok") else None
            if values:  # an object removed since the listing has none: skipped
                sizes[key] = int(values[0]["size_"])
    return sizes


def _http_get(admin_url: str, path: str) -> bytes:
    try:
        with urllib.request.urlopen(admin_url.rstrip("/") + path, timeout=10) as resp:
            return bytes(resp.read())
    except (urllib.error.URLError, OSError) as exc:
        raise BackendUnavailableError(
            f"cannot list Mooncake objects: the master's admin server at {admin_url} "
            f"did not answer ({exc}); check admin_url (the master's --metrics_port)"
        ) from exc
