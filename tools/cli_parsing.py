"""Argparse helpers of the ``hicache`` command: subcommands built on demand, typed converters.

Building every subcommand's parser up front would import every subcommand's module, and some of
them (``serve``, ``bench layouts``, ``bench controller``) import torch, which takes a second or
more. :func:`add_commands` registers every subcommand under its name and help, so ``--help``
lists them all, but builds in full, importing its module, only the one the command line names.

The ``type=`` converters below check a value when the command line is parsed, so a bad one is
a usage error (exit 2) before anything runs: numbers are finite and in range, with an upper
bound wherever the value sizes an allocation.

A parser's options may be declared as a table of :class:`Flag` rows, which :func:`add_flags`
adds; keyed by the config field each one sets, the same table also reads the parsed values
back (:func:`fields_from`), so a flag and the field it sets are named in one place.
"""

from __future__ import annotations

import argparse
import builtins
import enum
import importlib
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

__all__ = [
    "Command",
    "CommandFailed",
    "Flag",
    "add_commands",
    "add_flags",
    "arg_type",
    "check_disk",
    "check_memory",
    "chosen_command",
    "duration_range",
    "fields_from",
    "float_range",
    "host_memory",
    "input_dir",
    "input_file",
    "int_range",
    "output_file",
    "path_arg",
    "size_range",
    "url_arg",
]


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, and what adds its full parser.

    ``builder`` is ``"module:function"``. The function adds the subcommand's parser to the
    subparsers action it is given, with this same help, and returns that parser. With
    ``nested``, the subcommand has subcommands of its own, and the function also takes the
    tokens after the subcommand's name, to build those on demand in turn.
    """

    help: str
    builder: str
    nested: bool = False

    def build(self, sub: Any, rest: Sequence[str]) -> argparse.ArgumentParser:
        """Import the builder's module and add the full parser to ``sub``."""
        module_name, _, function_name = self.builder.partition(":")
        function = getattr(importlib.import_module(module_name), function_name)
        parser: argparse.ArgumentParser = function(sub, rest) if self.nested else function(sub)
        return parser


def chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first token that is not an option; None if none.

    This is the token argparse itself takes as the subcommand as long as no option before the
    subcommand takes a value, which holds for every parser :func:`add_commands` serves (their
    own options are ``-h`` and ``-v``).
    """
    return next((token for token in argv if not token.startswith("-")), None)


def add_commands(sub: Any, commands: Mapping[str, Command], argv: Sequence[str]) -> None:
    """Add each of ``commands`` to the subparsers action ``sub``, in order.

    The one ``argv`` names gets its full parser; each other gets a bare parser that carries its
    help for the listing and is never parsed into (argparse only descends into the named one).
    With no subcommand named, or an unknown one, all are bare and argparse reports the error.
    """
    chosen = chosen_command(argv)
    for name, command in commands.items():
        if name == chosen:
            rest = argv[list(argv).index(name) + 1 :]
            command.build(sub, rest)
        else:
            sub.add_parser(name, help=command.help)


def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type=`` from a parser that raises ValueError: a usage error, not a trace."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


@dataclass(frozen=True)
class Flag:
    """One option of a parser, as data: its name and what ``add_argument`` is given for it.

    Only the fields that are set are passed on, so argparse's own defaults hold for the rest
    (no ``type``: the text; no ``default``: None).
    """

    name: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    help: str | None = None
    _: KW_ONLY
    metavar: str | None = None
    action: str | None = None
    choices: Sequence[str] | None = None
    nargs: str | None = None

    @classmethod
    def switch(cls, name: str, help: str | None = None) -> Flag:
        """An option without a value: True when given, else False."""
        return cls(name, help=help, action="store_true")

    @classmethod
    def choice(
        cls, name: str, kind: builtins.type[enum.Enum], default: enum.Enum, help: str
    ) -> Flag:
        """An option whose value is one of the enum ``kind``'s values (kept as that text)."""
        return cls(name, default=default.value, help=help, choices=[k.value for k in kind])

    @classmethod
    def file(cls, name: str, help: str) -> Flag:
        """A FILE that must exist and be readable when the command line is parsed."""
        return cls(name, input_file, help=help, metavar="FILE")

    @property
    def dest(self) -> str:
        """The attribute of the parsed namespace that holds the value."""
        return self.name.lstrip("-").replace("-", "_")

    def add_to(self, parser: argparse._ActionsContainer) -> None:
        """Add this option to ``parser`` (a parser or one of its argument groups)."""
        # A list default (an append option's) is copied: no two parsers share one list.
        default = list(self.default) if isinstance(self.default, list) else self.default
        given: dict[str, Any] = {
            "type": self.type,
            "default": default,
            "help": self.help,
            "metavar": self.metavar,
            "action": self.action,
            "choices": self.choices,
            "nargs": self.nargs,
        }
        parser.add_argument(self.name, **{k: v for k, v in given.items() if v is not None})


def add_flags(parser: argparse._ActionsContainer, flags: Iterable[Flag]) -> None:
    """Add each of ``flags`` to ``parser`` (a parser or an argument group), in order."""
    for flag in flags:
        flag.add_to(parser)


def fields_from(args: argparse.Namespace, flags: Mapping[str, Flag]) -> dict[str, Any]:
    """The parsed values of ``flags``, a table keyed by the config field each flag sets."""
    return {field: getattr(args, flag.dest) for field, flag in flags.items()}


class CommandFailed(Exception):
    """A command ran and failed (exit status 1); its message is the one line printed.

    Usage errors (a bad flag, a bad config value, an input file that cannot be read) exit 2.
    """


def _converter(
    name: str, check: Callable[[str], Any], bounds: tuple[float, float] | None = None
) -> Callable[[str], Any]:
    """``check`` as an argparse ``type=``: its ValueError becomes a usage error. ``bounds``,
    the range a number must be in, is kept on the converter as ``bounds`` (for tests and
    help)."""
    convert = arg_type(check)
    convert.__name__ = name  # argparse names the type in some of its messages
    setattr(convert, "bounds", bounds)  # noqa: B010 - a function attribute mypy does not know
    return convert


def int_range(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``[low, high]``; anything else is a usage error saying the range."""

    def check(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise ValueError(f"must be an integer in [{low}, {high}], got {value}")
        return value

    return _converter("int", check, (low, high))


def float_range(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``low_open``); NaN and the
    infinities are refused."""

    def check(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError(f"not a number: {text!r}") from None
        opening = "(" if low_open else "["
        inside = low < value <= high if low_open else low <= value <= high  # NaN fails both
        if not (math.isfinite(value) and inside):
            raise ValueError(
                f"must be a finite number in {opening}{low:g}, {high:g}], got {text!r}"
            )
        return value

    return _converter("float", check, (low, high))


def size_range(low: int, high: int) -> Callable[[str], int]:
    """A byte count (``4096``, ``64K``, ``2M``) in ``[low, high]``."""
    from hicache.typed_config import parse_size

    def check(text: str) -> int:
        value = parse_size(text)
        if not low <= value <= high:
            raise ValueError(f"must be a size in [{low}, {high}] bytes, got {value}")
        return value

    return _converter("size", check, (low, high))


def duration_range(high: float) -> Callable[[str], float]:
    """A duration (``90s``, ``15m``, ``12h``, ``7d``) of at most ``high`` seconds."""
    from hicache.typed_config import parse_duration

    def check(text: str) -> float:
        value = parse_duration(text)
        if value > high:
            raise ValueError(f"must be at most {high:g} seconds, got {text!r}")
        return value

    return _converter("duration", check, (0.0, high))


def _plain_text(what: str, text: str) -> str:
    if not text.strip():
        raise ValueError(f"{what} is empty")
    if "\x00" in text:
        raise ValueError(f"{what} holds a NUL byte: {text!r}")
    return text


def _path_arg(text: str) -> str:
    """A path to be made or opened later: not empty, no NUL byte."""
    return _plain_text("the path", text)


def _url_arg(text: str) -> str:
    """A store URL: not empty, no NUL byte (not even percent-encoded: ``%00``)."""
    if "%00" in text:
        raise ValueError(f"the URL holds a NUL byte (%00): {text!r}")
    return _plain_text("the URL", text)


def _input_file(text: str) -> str:
    """A regular file that exists and can be read."""
    _plain_text("the path", text)
    if not os.path.exists(text):
        raise ValueError(f"no such file: {text!r}")
    if not os.path.isfile(text):
        raise ValueError(f"not a regular file: {text!r}")
    if not os.access(text, os.R_OK):
        raise ValueError(f"cannot read {text!r}: permission denied")
    return text


def _output_file(text: str) -> str:
    """A file to write: not a directory, in a directory that exists."""
    _plain_text("the path", text)
    if text.endswith(os.sep) or os.path.isdir(text):
        raise ValueError(f"{text!r} is a directory; name a file in it")
    parent = os.path.dirname(text) or "."
    if not os.path.isdir(parent):
        raise ValueError(f"no such directory: {parent!r}")
    return text


def _input_dir(text: str) -> str:
    """A directory that exists."""
    _plain_text("the path", text)
    if not os.path.isdir(text):
        raise ValueError(f"no such directory: {text!r}")
    return text


path_arg = _converter("path", _path_arg)
url_arg = _converter("URL", _url_arg)
input_file = _converter("file", _input_file)
output_file = _converter("file", _output_file)
input_dir = _converter("directory", _input_dir)


def host_memory() -> int:
    """Bytes of memory this process may use: the machine's, or less where a cgroup limit or an
    address-space limit (``ulimit -v``) says so."""
    import resource

    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text.isdigit():
            limits.append(int(text))
    except OSError:
        pass
    return min(limits)


def check_memory(nbytes: int, what: str) -> None:
    """Refuse a run whose buffers, ``nbytes`` of them (``what`` names the flags that size
    them), would take more than half of :func:`host_memory`: a usage error (exit 2)."""
    from hicache.errors import ConfigError

    ram = host_memory()
    if nbytes > ram // 2:
        raise ConfigError(
            f"{what} is {nbytes / 2**30:.1f} GiB of buffers, more than half of the "
            f"{ram / 2**30:.1f} GiB of memory here; lower them"
        )


def check_disk(directory: str, nbytes: int, what: str, where: str, lower: str) -> None:
    """Refuse a run that would write ``nbytes`` under ``directory``, more than is free there: a
    usage error (exit 2) saying that ``what`` need them, ``where`` that is, and what to
    ``lower``."""
    from hicache.errors import ConfigError

    free = shutil.disk_usage(directory).free
    if nbytes > free:
        raise ConfigError(
            f"{what} need {nbytes / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free "
            f"{where}; {lower}"
        )
