"""The ``--api-keys`` file: which key belongs to which tenant, and a tenant's priority cap.

One key a line, ``KEY TENANT`` or ``KEY TENANT max_priority=N``; blank lines and ``#``
comments are skipped. ``max_priority=N`` (0 to :data:`MAX_PRIORITY`) is the highest
``priority`` the tenant's requests may ask for, in place of the server's ``--max-priority``.
The cap is the tenant's, not the line's: every key of the tenant has it, a line without the
field leaves it as another line set it, and two lines giving the tenant different caps are an
error.
"""

from __future__ import annotations

import logging
import os
import pathlib
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from hicache.errors import ConfigError
from hicache.server.request_body import MAX_PRIORITY

__all__ = ["MIN_KEY_CHARS", "KeyFile", "parse_key_file", "read_key_file", "warn_if_others_can_read"]

logger = logging.getLogger(__name__)

MIN_KEY_CHARS = 8
MAX_TENANT_CHARS = 128
_MAX_KEY_FILE_BYTES = 1 << 20
_CAP_FIELD = "max_priority="


@dataclass(frozen=True, slots=True)
class KeyFile:
    """What a key file says: key -> tenant, and tenant -> priority cap for the tenants that
    have one."""

    keys: Mapping[str, str] = field(default_factory=dict)
    priority_caps: Mapping[str, int] = field(default_factory=dict)


def parse_key_file(text: str, source: str) -> KeyFile:
    """The keys and priority caps of a key file's ``text``.

    Raises :class:`ConfigError` naming the line (never its key) for a line of fewer than two
    or more than three fields, a short or repeated key, an overlong tenant name, a third field
    that is not ``max_priority=N`` in range, or a tenant given two different caps.
    """
    keys: dict[str, str] = {}
    caps: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source}:{number}"
        if len(fields) not in (2, 3):
            raise ConfigError(
                f"{where}: want 'KEY TENANT [{_CAP_FIELD}N]', got {len(fields)} fields"
            )
        key, tenant = fields[:2]
        _check_line(where, key, tenant, keys)
        keys[key] = tenant
        if len(fields) == 3:
            cap = _cap(where, fields[2])
            if caps.setdefault(tenant, cap) != cap:
                raise ConfigError(
                    f"{where}: another line gives the tenant {tenant!r} {_CAP_FIELD}{caps[tenant]}"
                )
    return KeyFile(keys, caps)


def _check_line(where: str, key: str, tenant: str, seen: Mapping[str, str]) -> None:
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"{where}: a key has at least {MIN_KEY_CHARS} characters")
    if key in seen:
        raise ConfigError(f"{where}: this key is listed twice")
    if len(tenant) > MAX_TENANT_CHARS or not tenant.isprintable():
        raise ConfigError(f"{where}: a tenant is 1-{MAX_TENANT_CHARS} printable characters")


def _cap(where: str, text: str) -> int:
    name, _, value = text.partition("=")
    # ASCII digits only: int() would also take "+5", "5_0" and other scripts' digits.
    if f"{name}=" != _CAP_FIELD or not (value.isascii() and value.isdigit()):
        raise ConfigError(f"{where}: the third field is '{_CAP_FIELD}N', got {text!r}")
    # Length first: int() refuses strings of thousands of digits with a ValueError.
    if len(value) > len(str(MAX_PRIORITY)) or int(value) > MAX_PRIORITY:
        raise ConfigError(f"{where}: {_CAP_FIELD}N takes 0 to {MAX_PRIORITY}, got {value[:16]}")
    return int(value)


def read_key_file(path: pathlib.Path) -> KeyFile:
    """:func:`parse_key_file` of the file at ``path`` (warned about if others may read it);
    :class:`ConfigError` for a file that cannot be read, is over 1 MiB or is not UTF-8."""
    try:
        with open(path, "rb") as f:
            warn_if_others_can_read(f.fileno(), path)
            raw = f.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc.strerror}") from None
    if len(raw) > _MAX_KEY_FILE_BYTES:
        raise ConfigError(f"the API key file {path} is over {_MAX_KEY_FILE_BYTES} bytes")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"the API key file {path} is not UTF-8 text") from None
    return parse_key_file(text, str(path))


def warn_if_others_can_read(fd: int, path: pathlib.Path) -> None:
    """Log a warning for a secret file that its group or other users may read."""
    mode = os.fstat(fd).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "%s is readable by other users (mode %o): keep secrets in a 0600 file",
            path,
            stat.S_IMODE(mode),
        )
