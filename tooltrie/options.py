"""Command-line options shared by several commands, light to import (``--help`` loads no compiler)."""

from __future__ import annotations

import argparse
import re


def separator_text(text: str) -> str:
    r"""``--separator``'s value: ``\n``, ``\t`` and ``\\`` typed in a shell are the characters they name.

    >>> separator_text(r"\n"), separator_text(", "), separator_text(r"a\\nb")
    ('\n', ', ', 'a\\nb')
    """
    escapes = {"n": "\n", "t": "\t", "\\": "\\"}
    return re.sub(r"\\([nt\\])", lambda match: escapes[match.group(1)], text)


def add_separator_option(command: argparse.ArgumentParser, *, default: str | None = None) -> None:
    """``--separator`` on a command: with a ``default`` the command compiles; without one, it compiles registry files
    with it (an artifact holds its own)."""
    where = "" if default is not None else " where a registry file is compiled (an artifact holds its own)"
    command.add_argument("--separator", type=separator_text, default=default,
                         help=f"the contract's separator{where}; \\n, \\t and \\\\ are read as escapes "
                              "(default: ', ')")
