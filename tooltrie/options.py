"""Command-line options shared by several commands, light to import (``--help`` loads no compiler)."""

from __future__ import annotations

import argparse
import re
from typing import Any


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


def add_quiet_option(command: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress shown (``tooltrie/progress.py``); what the command makes or answers is still said."""
    command.add_argument("--quiet", action="store_true",
                         help="no progress (a bar on a terminal, a line each tenth of the way elsewhere)")


def fused_weights(text: str) -> Any:
    """``--fused-weights MODEL,RETRIEVAL``: how much the model's scores and the retrieval similarity count."""
    from tooltrie.ranker import Weights

    try:
        model, retrieval = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MODEL,RETRIEVAL (two numbers), got {text!r}") from None
    return Weights(model=model, retrieval=retrieval)


def add_ranker_options(command: argparse.ArgumentParser, *, what: str = "the", default: str = "auto") -> None:
    """``--ranker``, ``--prior`` and ``--fused-weights`` (names kept in step with ``tooltrie/ranker.py``)."""
    from tooltrie.ranker import DEFAULT_PRIOR, NO_ADAPTER, PRIORS, RANKERS, UNTRAINED

    auto = ("auto: on the registry its adapter was trained on, what the adapter's record chose (the shipped "
            "adapter's: fused), elsewhere fused; fused only where the prior can be made (lexical always, dense and "
            "hybrid where all-MiniLM-L6-v2 is installed), else the model; a model without an adapter: the prior alone")
    command.add_argument("--ranker", choices=("auto", *RANKERS), default=default,
                         help=f"what {what} answers rank by: the model, retrieval (the prior alone), both fused "
                              f"inside the decode, or {auto} (default: {default})")
    command.add_argument("--prior", choices=PRIORS, default=DEFAULT_PRIOR,
                         help="the retrieval prior: dense (all-MiniLM-L6-v2 similarity), lexical (BM25 over the "
                              "words inside the tools' names and text) or hybrid (both; default: "
                              f"{DEFAULT_PRIOR})")
    command.add_argument("--fused-weights", type=fused_weights, default=None, metavar="MODEL,RETRIEVAL",
                         help="the fused ranker's weights (default: on the registry the adapter was trained on, "
                              f"its own; elsewhere {UNTRAINED.model:g},{UNTRAINED.retrieval:g}: retrieval leading; "
                              f"without an adapter {NO_ADAPTER.model:g},{NO_ADAPTER.retrieval:g})")

