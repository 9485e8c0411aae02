"""Backend URLs shown to people: credentials redacted, and checked against an allow-list.

A URL may carry credentials in its user-info (``s3://KEY:SECRET@bucket``) or in query options
(``?secret=…``, ``key=``, ``api_key=``, ``token=``, ``password=``, in any case).
:func:`redact_url` replaces each with ``***``; :func:`scrub` also replaces them inside a
message that repeats them (an error raised while opening the URL may quote it).

:func:`allowed_by` decides whether a URL lies under an allow-list prefix: for a local store
(``file``, ``nixl``, ``3fs``) its path, resolved through every link and with no ``..``
in it, must lie inside the prefix's resolved path; for any other store the host and path must
start with the prefix's, and the query must be the prefix's own (so options that choose where
a client connects, such as ``endpoint_url``, cannot be added).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

__all__ = ["allowed_by", "redact_url", "scrub"]

# An option whose name ends in one of these words carries a credential (key=, api_key=,
# secret_access_key=, token=, session_token=, password=, ...); key_prefix= does not.
_SECRET_NAME = re.compile(
    r"(?:^|[_.-])(?:key|secret|token|password|passwd|pwd|credentials?|auth|signature|sig)$",
    re.IGNORECASE,
)
_LOCAL_SCHEMES = frozenset({"file", "disk", "nixl", "3fs"})
_MASK = "***"


def _secrets(url: str) -> list[str]:
    """The credential values ``url`` carries, longest first."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = [parts.password or "", parts.username or ""] if "@" in parts.netloc else []
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    found += [v for k, v in pairs if _SECRET_NAME.search(k)]
    return sorted({s for s in found if s}, key=len, reverse=True)


def redact_url(url: str) -> str:
    """``url`` with every credential replaced by ``***`` (user-info, secret-named options)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _MASK
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{_MASK}@{netloc.rpartition('@')[2]}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = urlencode([(k, _MASK if _SECRET_NAME.search(k) else v) for k, v in pairs], safe="*/:")
    shown = urlunsplit((parts.scheme, netloc, parts.path, query, ""))
    # urlunsplit drops an empty authority's "//" for schemes it does not know (disk:///a would
    # come back as disk:/a): keep the form the URL was given in.
    lead = f"{parts.scheme}://"
    if url.startswith(lead) and not shown.startswith(lead):
        shown = lead + shown[len(parts.scheme) + 1 :]
    return shown


def scrub(text: str, url: str) -> str:
    """``text`` with ``url`` shown redacted and each of its credentials masked."""
    text = text.replace(url, redact_url(url))
    for secret in _secrets(url):
        text = text.replace(secret, _MASK)
    return text


def allowed_by(url: str, prefixes: Sequence[str]) -> str | None:
    """The first of ``prefixes`` that ``url`` lies under, or None."""
    for prefix in prefixes:
        if _under(url, prefix):
            return prefix
    return None


def _under(url: str, prefix: str) -> bool:
    try:
        got, rule = urlsplit(url), urlsplit(prefix)
    except ValueError:
        return False
    if got.scheme.lower() != rule.scheme.lower() or got.scheme == "":
        return False
    if got.scheme.lower() in _LOCAL_SCHEMES:
        return _local_under(got.netloc, unquote(got.path), unquote(rule.path))
    if sorted(parse_qsl(got.query)) != sorted(parse_qsl(rule.query)):
        return False
    return f"{got.netloc}{got.path}".startswith(f"{rule.netloc}{rule.path}")


def _local_under(netloc: str, path: str, root: str) -> bool:
    if netloc not in ("", "localhost") or not path.startswith("/") or not root:
        return False
    if ".." in path.split("/"):
        return False
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip("/") + "/")
