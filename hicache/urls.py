"""Backend URLs shown to people: credentials redacted.

A URL may carry credentials in its user-info (``s3://KEY:SECRET@bucket``) or in query options
(``?secret=…``, ``key=``, ``api_key=``, ``token=``, ``password=``, in any case).
:func:`redact_url` replaces each with ``***``; :func:`scrub` also replaces them inside a
message that repeats them (an error raised while opening the URL may quote it).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["redact_url", "scrub"]

# An option whose name ends in one of these words carries a credential (key=, api_key=,
# secret_access_key=, token=, session_token=, password=, ...); key_prefix= does not.
_SECRET_NAME = re.compile(
    r"(?:^|[_.-])(?:key|secret|token|password|passwd|pwd|credentials?|auth|signature|sig)$",
    re.IGNORECASE,
)
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
