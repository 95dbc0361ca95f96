"""Requests composed from a registry's own text, for training without labelled queries.

A registry alone gives one request per tool (its description) and a few examples, each naming one tool; agents'
requests chain tasks. Here each tool's task is its description's first sentence, and requests of k = 2 or 3 chain
the tasks of distinct tools in connective templates ("First, ... Then ..."); the label lists the tools in the order
the request names them. Single-tool requests get instruction templates around the same task. Deterministic for a
seed; the answers are trie paths like every other record's (``RecordMaker`` verifies each one).

>>> from tooltrie.registry import make_registry
>>> registry = make_registry([{"name": "get_weather", "description": "Get the forecast for a city. Uses METAR."},
...                           {"name": "send_mail", "description": "Send an email to a contact."}], name="demo")
>>> task(registry.tools[0])
'get the forecast for a city'
>>> [(q.query, q.tools) for q in composed_examples(registry, n_multi=1, seed=3)][-1]
('I need two things: send an email to a contact; and get the forecast for a city.', ('send_mail', 'get_weather'))
"""

from __future__ import annotations

import random
import re

from tooltrie.eval.datasets import LabelledQuery
from tooltrie.registry.model import Registry, Tool

SINGLE = ("{a}.", "Can you help me {a}?", "I need to {a}.", "Please {a}.")
CHAINS = {
    2: ("{a}, and also {b}.", "First, {a}. Then {b}.", "I need two things: {a}; and {b}.",
        "Could you {a} and {b}?"),
    3: ("{a}, {b}, and {c}.", "First, {a}. Then {b}. Finally, {c}.", "Three things: {a}; {b}; {c}."),
}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def task(tool: Tool) -> str:
    """What the tool does, as a phrase: its description's first sentence without the final stop, starting in lower
    case unless its first word is an acronym; the name's words when there is no description."""
    text = _SENTENCE_END.split(tool.description.strip(), maxsplit=1)[0].rstrip(".!? ")
    if not text:
        return re.sub(r"[_\-.]+", " ", tool.name).strip()
    first = text.split(" ", 1)[0]
    return text if first.isupper() and len(first) > 1 else text[0].lower() + text[1:]


def composed_examples(registry: Registry, *, n_multi: int, seed: int = 0) -> list[LabelledQuery]:
    """One templated request per tool, then ``n_multi`` requests chaining 2 or 3 distinct tools' tasks."""
    rng = random.Random(f"compose:{seed}")
    tools = list(registry.tools)
    items = [_query(rng.choice(SINGLE), [tool], registry, "single") for tool in tools]
    for i in range(n_multi):
        k = min(rng.choice((2, 2, 3)), len(tools))
        if k < 2:
            break
        items.append(_query(rng.choice(CHAINS[k]), rng.sample(tools, k), registry, f"chain {i + 1}"))
    return items


def _query(template: str, tools: list[Tool], registry: Registry, what: str) -> LabelledQuery:
    phrases = dict(zip("abc", (task(tool) for tool in tools), strict=False))
    text = template.format(**phrases)
    return LabelledQuery(text[:1].upper() + text[1:], tuple(tool.name for tool in tools),
                         where=f"{registry.source or registry.name}: composed ({what})")


__all__ = ["composed_examples", "task"]
