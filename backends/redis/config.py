"""The options of a ``redis://``, ``rediss://``, ``valkey://`` or ``valkeys://`` URL.

``redis://[[user]:password@]host[:port][/db]?option=value&...``: the location names one server
(or, with ``cluster=true``, any node of a cluster); with ``sentinel=host:port,...`` it names no
host, the sentinels do. The ``s`` schemes turn TLS on. Credentials come from the URL's user part,
``password_file=``, or the ``HICACHE_REDIS_PASSWORD`` environment variable (read where a URL
becomes a config, :func:`password_from_env`, never by the config itself); sentinels that ask
for a password of their own get ``sentinel_password=`` or ``sentinel_password_file=``. Neither
appears in the config's repr or in an error.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import unquote, urlsplit

from hicache.errors import ConfigError

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "PASSWORD_ENV",
    "TLS_SCHEMES",
    "RedisConfig",
    "location_fields",
    "password_from_env",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 6379
SENTINEL_PORT = 26379
PASSWORD_ENV = "HICACHE_REDIS_PASSWORD"
TLS_SCHEMES = frozenset({"rediss", "valkeys"})
# Glob characters are left out so that SCAN's MATCH pattern is the prefix itself, and braces
# so that no prefix is a hash tag (which would put every key of a cluster in one slot).
_PREFIX_RE = re.compile(r"[A-Za-z0-9._:/-]{0,64}\Z")
_SECRET_FIELDS = frozenset({"password", "sentinel_password"})
_TLS_FILES = ("ca_file", "cert_file", "key_file")


@dataclass(frozen=True, slots=True, repr=False)
class RedisConfig:
    """One Redis or Valkey deployment and how pages are kept in it (see the module docstring)."""

    host: str = ""  # "" is DEFAULT_HOST; no host at all with sentinel=
    port: int = DEFAULT_PORT
    db: int = 0  # the URL's path, /N; a cluster has only db 0
    username: str | None = None  # an ACL user; None is the "default" user
    password: str | None = None
    password_file: str | None = None  # a file holding the password (one line)
    tls: bool = False  # set by the scheme: rediss:// and valkeys://
    ca_file: str | None = None  # the CA that signed the server's certificate
    cert_file: str | None = None  # a client certificate, for servers that ask for one
    key_file: str | None = None  # its private key
    cluster: bool = False  # a Redis Cluster: keys spread by hash slot over its masters
    sentinel: str = ""  # host:port,host:port of the sentinels that watch the master
    service: str = ""  # the master's name at the sentinels
    # The sentinels' own password (their requirepass), where they ask for one; not the master's.
    sentinel_password: str | None = None
    sentinel_password_file: str | None = None  # a file holding it (one line)
    key_prefix: str = "hicache:"  # every key of this store starts with it
    ttl: int = 0  # seconds a page lives after it was last stored or read; 0: no expiry
    max_connections: int = 32  # per server (per node in a cluster)
    timeout: float = 5.0  # seconds to connect, and for each batch (all its replies)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"RedisConfig.port must be 1 to 65535, got {self.port}")
        if self.db < 0:
            raise ConfigError(f"RedisConfig.db must be 0 or more, got {self.db}")
        if not _PREFIX_RE.match(self.key_prefix):
            raise ConfigError(
                f"RedisConfig.key_prefix {self.key_prefix!r}: up to 64 of letters, digits "
                "and . _ : / -"
            )
        if self.ttl < 0:
            raise ConfigError(f"RedisConfig.ttl must be 0 (no expiry) or more, got {self.ttl}")
        if self.max_connections <= 0:
            raise ConfigError(
                f"RedisConfig.max_connections must be positive, got {self.max_connections}"
            )
        if not self.timeout > 0:
            raise ConfigError(f"RedisConfig.timeout must be positive seconds, got {self.timeout}")
        if self.password is not None and self.password_file is not None:
            raise ConfigError("RedisConfig: give password or password_file, not both")
        if not self.tls:
            given = [name for name in _TLS_FILES if getattr(self, name) is not None]
            if given:
                raise ConfigError(
                    f"RedisConfig.{given[0]} is a TLS option: use rediss:// or valkeys://"
                )
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("RedisConfig: cert_file and key_file go together")
        self._check_mode()

    def _check_mode(self) -> None:
        if self.cluster and self.db != 0:
            raise ConfigError(f"RedisConfig.db: a cluster has only db 0, got {self.db}")
        if self.sentinel:
            if self.cluster:
                raise ConfigError("RedisConfig: sentinel and cluster=true exclude each other")
            if self.host:
                raise ConfigError(
                    f"RedisConfig.sentinel: the sentinels find the master; the URL names no "
                    f"host, got {self.host!r}"
                )
            if not self.service:
                raise ConfigError("RedisConfig.sentinel needs service=NAME (the master's name)")
            self.sentinels()  # refuse a bad list now, not at open
        elif self.service:
            raise ConfigError("RedisConfig.service is the master's name at sentinel=...")
        sentinel_auth = (self.sentinel_password, self.sentinel_password_file)
        if any(value is not None for value in sentinel_auth) and not self.sentinel:
            raise ConfigError("RedisConfig.sentinel_password is for sentinel=... only")
        if None not in sentinel_auth:
            raise ConfigError(
                "RedisConfig: give sentinel_password or sentinel_password_file, not both"
            )

    @property
    def address(self) -> tuple[str, int]:
        """The server (or cluster node) the location names."""
        return self.host or DEFAULT_HOST, self.port

    def sentinels(self) -> list[tuple[str, int]]:
        """``sentinel=`` as (host, port) pairs; a port left out is 26379."""
        out = []
        for item in self.sentinel.split(","):
            try:
                host, port = _host_port(item.strip())
            except ConfigError as exc:
                raise ConfigError(f"RedisConfig.sentinel: {exc}") from None
            if not host:
                raise ConfigError(f"RedisConfig.sentinel: {item!r} names no host")
            out.append((host, SENTINEL_PORT if port is None else port))
        return out

    def read_password(self) -> str | None:
        """The password: given, or read from ``password_file`` (its first line)."""
        return _secret(self.password, self.password_file, "password_file")

    def read_sentinel_password(self) -> str | None:
        """The sentinels' password: given, or read from ``sentinel_password_file``."""
        return _secret(
            self.sentinel_password, self.sentinel_password_file, "sentinel_password_file"
        )

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            text = "'***'" if f.name in _SECRET_FIELDS and value is not None else repr(value)
            shown.append(f"{f.name}={text}")
        return f"RedisConfig({', '.join(shown)})"


def _secret(given: str | None, path: str | None, option: str) -> str | None:
    """``given``, or the first line of the file at ``path``; errors name the option and the
    file, never what it holds."""
    if path is None:
        return given
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(f"RedisConfig.{option} {path!r}: {exc.strerror}") from None
    if not line:
        raise ConfigError(f"RedisConfig.{option} {path!r} is empty")
    return line


def _host_port(text: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``; the port is None when left out."""
    try:
        parts = urlsplit("x://" + text)
        port = parts.port
    except ValueError:
        raise ConfigError(f"{text!r} is not host:port (the port is 1 to 65535)") from None
    if parts.path or parts.query or parts.fragment or "@" in parts.netloc:
        raise ConfigError(f"{text!r} is not host:port")
    return unquote(parts.hostname or ""), port


def location_fields(netloc: str, path: str) -> dict[str, Any]:
    """The config fields a URL's location sets: host, port, credentials, db.

    No error quotes the user part: it holds the password.
    """
    user_part, at, hostport = netloc.rpartition("@")
    out: dict[str, Any] = {}
    if hostport:
        host, port = _host_port(hostport)
        out["host"] = host
        if port is not None:
            out["port"] = port
    if at:
        user, colon, password = user_part.partition(":")
        if user:
            out["username"] = unquote(user)
        if colon:
            out["password"] = unquote(password)
    db = path.strip("/")
    if db:
        if not db.isdigit():
            raise ConfigError(f"a redis URL's path is the database number, /N; got {path!r}")
        out["db"] = int(db)
    return out


def password_from_env() -> str | None:
    """``HICACHE_REDIS_PASSWORD``, for a URL that gives no password of its own."""
    return os.environ.get(PASSWORD_ENV) or None
