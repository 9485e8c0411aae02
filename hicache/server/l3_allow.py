"""The ``--l3-allow`` rules: which backend URLs ``POST /admin/l3/attach`` may open.

A rule is a backend URL, ``SCHEME://[HOST[:PORT]][/PATH][?NAME=VALUE&NAME=*...]``. Both the rule
and the attach URL are read as :func:`~hicache.backends.registry.open_backend` reads them (its
registry resolves the scheme, and the location and query are split as the backends' config
builder splits them), and nothing is opened. A URL lies under a rule when:

- **Backend**: its scheme names the same backend as the rule's, in any case; aliases are one
  (``hf3fs://`` is ``3fs://``, ``fsspec+s3://`` is ``s3://``). A backend with a config builder
  of its own may read the scheme (fsspec: ``s3`` and ``gs`` are other stores), so for it the
  schemes must be equal.
- **Host**: its ``[user-info@]host[:port]`` is the rule's exactly, as written (not decoded).
  A rule without a port admits only URLs without one. User-info is part of the host: no built-in
  backend takes credentials from it (fsspec and the local stores refuse it; nixl, mooncake and
  shm read it as part of the bucket, master or name). A local store's ``localhost`` is no host.
- **Path**: for a local store (``file``, ``disk``, ``3fs``, ``nixl`` with no host) the path,
  resolved through every link, lies inside the rule's resolved path; for any other the decoded
  path lies under the rule's by whole segments (``s3://kv`` admits ``s3://kv/a``, not
  ``s3://kv-other``).
- **No ``..``**: neither holds ``..`` in its host, path, query or fragment, however often
  percent-encoded (``%2e%2E``, ``%252e``).
- **Options**: each query option is named by the rule: ``NAME=VALUE`` in the rule requires the
  URL to give ``NAME=VALUE`` (compared as text); ``NAME=*`` admits any value, or none. Only
  :data:`SAFE_OPTIONS` need no rule. No option may be given twice.
- **Config**: the backend's config builder accepts the URL (an unknown option, a bad value).

:func:`check_allow_rules` refuses a rule that could never admit anything: an unknown scheme,
``..``, an option the backend does not have, or a location (with the options the rule fixes)
the backend's config builder refuses, such as a local store's relative path.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from hicache.backends.base import StorageBackend
from hicache.backends.registry import default_registry
from hicache.errors import BackendError, ConfigError, HiCacheError, InvalidArgumentError
from hicache.urls import redact_url, scrub

__all__ = [
    "ANY_VALUE",
    "SAFE_OPTIONS",
    "L3NotAllowedError",
    "admitting_rule",
    "allowed_by",
    "check_allow_rules",
]

ANY_VALUE = "*"  # a rule's NAME=* admits any value of NAME
# Options any URL may give: fsync only adds syncs. None that choose an address, a plugin,
# credentials, threads, sizes or read-only state.
SAFE_OPTIONS = frozenset({"fsync"})
_LOCAL_BACKENDS = frozenset({"file", "disk", "3fs", "nixl"})
_DECODE_ROUNDS = 8  # more percent-encoding layers than this is refused outright


class L3NotAllowedError(HiCacheError):
    """An attach URL that no ``--l3-allow`` rule admits."""


@dataclass(frozen=True, slots=True)
class _Location:
    """A backend URL as the registry and the config builder read it."""

    backend: type[StorageBackend]
    url: str  # what the backend is given: ``name+inner://`` gives it ``inner://``
    scheme: str  # of ``url``, lower case
    host: str  # [user-info@]host[:port] as given; "" for a local store's localhost
    path: str  # decoded
    options: tuple[tuple[str, str], ...]  # decoded, in order

    @property
    def local(self) -> bool:
        return self.backend.name in _LOCAL_BACKENDS and self.host == ""


def check_allow_rules(rules: Sequence[str]) -> None:
    """Raise InvalidArgumentError naming the first of ``rules`` that could admit nothing."""
    for text in rules:
        try:
            _rule(text)
        except (BackendError, InvalidArgumentError) as exc:
            why = scrub(str(exc), text)
            raise InvalidArgumentError(f"--l3-allow {redact_url(text)}: {why}") from None


def admitting_rule(url: str, rules: Sequence[str]) -> str:
    """The first of ``rules`` that admits ``url``.

    Raises L3NotAllowedError when none does; ConfigError (or another HiCacheError the backend's
    config builder raises) when ``url`` lies where a rule admits but the backend would refuse it.
    """
    try:
        got = _locate(url)
    except BackendError:
        raise L3NotAllowedError("its scheme names no backend that loads") from None
    except InvalidArgumentError as exc:
        raise L3NotAllowedError(str(exc)) from None
    placed = [(text, rule) for text, rule in _valid(rules) if _place_admits(rule, got)]
    if not placed:
        raise L3NotAllowedError("its backend, host or path is under no rule")
    got.backend.config_from_url(got.url, {})  # what open_backend would refuse, refused now
    refused: set[str] = set()
    for text, rule in placed:
        missing = _options_refused(dict(rule.options), got.options)
        if not missing:
            return text
        refused.update(missing)
    raise L3NotAllowedError(f"options not as a rule allows: {', '.join(sorted(refused))}")


def allowed_by(url: str, rules: Sequence[str]) -> str | None:
    """The first of ``rules`` that admits ``url`` (see :func:`admitting_rule`), or None; also
    None for a URL the backend's config builder refuses."""
    try:
        return admitting_rule(url, rules)
    except HiCacheError:
        return None


# ----- reading URLs ---------------------------------------------------------------------------
def _locate(url: str) -> _Location:
    """``url`` as :func:`open_backend` reads it. Raises BackendError for a scheme no backend
    handles, InvalidArgumentError for no backend URL or one with ``..``."""
    backend, inner = default_registry.resolve_url(url)
    scheme, _, rest = inner.partition("://")
    try:
        # As the config builder splits it: urlsplit drops a scheme that starts with a digit.
        parts = urlsplit("x://" + rest)
    except ValueError as exc:
        raise InvalidArgumentError(f"not a backend URL ({exc})") from None
    if any(_has_dots(text) for text in (parts.netloc, parts.path, parts.query, parts.fragment)):
        raise InvalidArgumentError("'..' in it (percent-encoded or not)")
    # As given, not decoded: nixl, mooncake and shm take it so (s3://kv%63ache is no match).
    host = parts.netloc
    if backend.name in _LOCAL_BACKENDS and host == "localhost":
        host = ""  # the local stores take localhost as no host
    options = tuple(parse_qsl(parts.query, keep_blank_values=True))
    return _Location(backend, inner, scheme.lower(), host, unquote(parts.path), options)


def _has_dots(text: str) -> bool:
    """Whether ``text`` holds ``..`` once percent-decoded, as often as it decodes further
    (a layer a backend or a proxy might decode again)."""
    for _ in range(_DECODE_ROUNDS):
        if ".." in text:
            return True
        once = unquote(text)
        if once == text:
            return False
        text = once
    return True  # still decoding: no URL anyone writes


def _rule(text: str) -> _Location:
    """``text`` read as a rule; InvalidArgumentError (or BackendError) when it admits nothing."""
    rule = _locate(text)
    names = [name for name, _ in rule.options]
    if len(set(names)) != len(names):
        raise InvalidArgumentError("an option is named twice")
    config_type = getattr(rule.backend, "config_type", None)
    if dataclasses.is_dataclass(config_type):
        known = {f.name for f in dataclasses.fields(config_type)}
        unknown = sorted(set(names) - known)
        if unknown:
            raise InvalidArgumentError(
                f"{rule.backend.name} has no option {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}"
            )
    if rule.local and not rule.path.startswith("/"):
        raise InvalidArgumentError(f"a {rule.scheme}:// rule needs an absolute path")
    # Its location and fixed options must be a store the backend would take (file://relative
    # is not); the options it lets vary are left out.
    fixed = urlencode([(name, value) for name, value in rule.options if value != ANY_VALUE])
    location = re.split(r"[?#]", rule.url, maxsplit=1)[0]
    try:
        rule.backend.config_from_url(f"{location}?{fixed}" if fixed else location, {})
    except ConfigError as exc:
        raise InvalidArgumentError(
            f"the {rule.backend.name} backend would refuse it: {exc}"
        ) from None
    return rule


def _valid(rules: Sequence[str]) -> Iterator[tuple[str, _Location]]:
    """The rules that read as rules; check_allow_rules refuses the others at start."""
    for text in rules:
        try:
            yield text, _rule(text)
        except (BackendError, InvalidArgumentError):
            continue


# ----- matching -------------------------------------------------------------------------------
def _place_admits(rule: _Location, got: _Location) -> bool:
    if rule.backend is not got.backend or rule.host != got.host:
        return False
    if _reads_scheme(got.backend) and rule.scheme != got.scheme:
        return False
    if rule.local:  # got is local too: same backend, same (no) host
        return _inside(got.path, rule.path)
    under = _segments(rule.path)
    return _segments(got.path)[: len(under)] == under


def _reads_scheme(backend: type[StorageBackend]) -> bool:
    # The base builder reads only the location and the query, so every scheme of a backend
    # that keeps it opens the same store; an override may read the scheme (fsspec's does).
    own = getattr(backend.config_from_url, "__func__", None)
    return own is not getattr(StorageBackend.config_from_url, "__func__", None)


def _segments(path: str) -> tuple[str, ...]:
    names = path.split("/")
    if path.startswith("/"):
        names = names[1:]
    while names and names[-1] == "":  # a trailing slash names no segment
        names.pop()
    return tuple(names)


def _inside(path: str, root: str) -> bool:
    """Whether ``path``, resolved through every link, lies inside ``root``'s resolved path."""
    if not path.startswith("/") or not root.startswith("/"):
        return False
    try:
        real, base = os.path.realpath(path), os.path.realpath(root)
    except (OSError, ValueError):  # a NUL byte, a link loop
        return False
    return real == base or real.startswith(base.rstrip("/") + "/")


def _options_refused(allowed: dict[str, str], given: Sequence[tuple[str, str]]) -> list[str]:
    """The names of the ``given`` options the rule's ``allowed`` ones do not admit, and of
    the options the rule fixes that ``given`` lacks."""
    names = [name for name, _ in given]
    # Given twice: the builder keeps one, and which is its business, not the rule's.
    refused = sorted({name for name in names if names.count(name) > 1})
    for name, value in dict(given).items():
        wanted = allowed.get(name)
        admitted = name in SAFE_OPTIONS if wanted is None else wanted in (ANY_VALUE, value)
        if not admitted and name not in refused:
            refused.append(name)
    return refused + [n for n, v in allowed.items() if v != ANY_VALUE and n not in names]
