"""Argparse helpers of the ``hicache`` command: subcommands built on demand, typed converters.

Building every subcommand's parser up front would import every subcommand's module, and some of
them (``serve``, ``bench layouts``, ``bench controller``) import torch, which takes a second or
more. :func:`add_commands` registers every subcommand under its name and help, so ``--help``
lists them all, but builds in full, importing its module, only the one the command line names.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Command", "add_commands", "arg_type", "chosen_command"]


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
