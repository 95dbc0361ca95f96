"""The exactly-k grammar at string level, as EBNF for XGrammar-style engines (GBNF dialect).

This is what a string-level stack can express of the contract: k names joined by the separator. It cannot say
"no repeats" without enumerating permutations (for k = 3 over 42 tools, a 3.3 MB grammar), so repeats slip
through it; the trie enforces them in the mask instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tooltrie.compiler.contract import Contract


def exactly_k_ebnf(names: Sequence[str], k: int, contract: Contract | None = None) -> str:
    """EBNF whose language is every rendering of k registry names (repeats included).

    >>> print(exactly_k_ebnf(["a", "b"], 2))
    root ::= tool ", " tool
    tool ::= "a" | "b"
    """
    contract = contract or Contract()
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    separator = _literal(contract.separator)
    root = f" {separator} ".join(["tool"] * k)
    alternatives = " | ".join(_literal(name) for name in names)
    return f"root ::= {root}\ntool ::= {alternatives}"


def _literal(text: str) -> str:
    # JSON string escapes (\", \\, \n, \uXXXX) are valid EBNF string escapes in XGrammar and llguidance.
    return json.dumps(text, ensure_ascii=False)
