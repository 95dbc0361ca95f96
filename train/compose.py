"""Requests composed from a registry's own text, for training without labelled queries.

A registry alone gives one request per tool (its description) and a few examples, each naming one tool; agents'
requests chain tasks. Here each tool's task is its description's first sentence, and requests of k = 2 or 3 chain
the tasks of distinct tools in connective templates ("First, ... Then ..."); the label lists the tools in the order
the request names them. Single-tool requests get instruction templates around the same task. A tool with parameters
also gets a request that gives its arguments the way users do ("... with base 7 and height 12"): an enum's value, a
number for a numeric type, and the parameter named by its words or its description otherwise. Deterministic for a
seed; the answers are trie paths like every other record's (``RecordMaker`` verifies each one).

>>> from tooltrie.registry import make_registry
>>> registry = make_registry([{"name": "get_weather", "description": "Get the forecast for a city. Uses METAR."},
...                           {"name": "send_mail", "description": "Send an email to a contact."}], name="demo")
>>> task(registry.tools[0])
'get the forecast for a city'
>>> [(q.query, q.tools) for q in composed_examples(registry, n_multi=1, seed=3)][-1]
('I need two things: send an email to a contact; and get the forecast for a city.', ('send_mail', 'get_weather'))
>>> area = make_registry([{"name": "triangle_area", "description": "Compute the area of a triangle.", "parameters": {
...     "properties": {"base": {"type": "integer"}, "heightCm": {"type": "number"}}}}], name="demo").tools[0]
>>> with_arguments(area, random.Random(1))
'Compute the area of a triangle with base 18 and height cm 73.'
"""

from __future__ import annotations

import random
import re

from tooltrie.eval.datasets import LabelledQuery
from tooltrie.registry.model import Parameter, Registry, Tool

SINGLE = ("{a}.", "Can you help me {a}?", "I need to {a}.", "Please {a}.")
# A task and its arguments ("base 7 and height 12"; or, without values, "the base and the height").
WITH_VALUES = ("{a} with {args}.", "Please {a}: {args}.", "I need to {a} for {args}.")
WITHOUT_VALUES = ("{a}, given {args}.", "I have {args}; {a}.", "Can you {a} from {args}?")
_MAX_ARGUMENTS = 3
_NUMERIC = frozenset({"integer", "int", "number", "float", "double", "long"})
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
    items += [_labelled(with_arguments(tool, rng), [tool], registry, "arguments") for tool in tools if tool.parameters]
    for i in range(n_multi):
        k = min(rng.choice((2, 2, 3)), len(tools))
        if k < 2:
            break
        items.append(_query(rng.choice(CHAINS[k]), rng.sample(tools, k), registry, f"chain {i + 1}"))
    return items


def with_arguments(tool: Tool, rng: random.Random) -> str:
    """A request for ``tool`` giving up to three of its arguments, the required ones first."""
    chosen = sorted(tool.parameters, key=lambda parameter: not parameter.required)[:_MAX_ARGUMENTS]
    valued = [(parameter, _value(parameter, rng)) for parameter in chosen]
    if all(value is not None for _, value in valued):
        args = [f"{_words(parameter.name)} {value}" for parameter, value in valued]
        template = rng.choice(WITH_VALUES)
    else:
        args = [_phrase(parameter, rng) for parameter in chosen]
        template = rng.choice(WITHOUT_VALUES)
    listed = args[0] if len(args) == 1 else f"{', '.join(args[:-1])} and {args[-1]}"
    text = template.format(a=task(tool), args=listed)
    return text[:1].upper() + text[1:]


def _value(parameter: Parameter, rng: random.Random) -> str | None:
    if parameter.values:
        return rng.choice(parameter.values)
    if parameter.type.lower() in _NUMERIC:
        return str(rng.randint(1, 100))
    return None


def _phrase(parameter: Parameter, rng: random.Random) -> str:
    """The parameter as a noun phrase: its words ("the file path"), or its description's first sentence."""
    described = _SENTENCE_END.split(parameter.description.strip(), maxsplit=1)[0].rstrip(".!? ")
    if described and rng.random() < 0.5:
        return described[0].lower() + described[1:]
    return f"the {_words(parameter.name)}"


def _words(name: str) -> str:
    """``fileName`` / ``file_name`` / ``file-name`` -> ``file name``."""
    return re.sub(r"[_\-.\s]+", " ", re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name)).strip().lower()


def _query(template: str, tools: list[Tool], registry: Registry, what: str) -> LabelledQuery:
    phrases = dict(zip("abc", (task(tool) for tool in tools), strict=False))
    text = template.format(**phrases)
    return _labelled(text[:1].upper() + text[1:], tools, registry, what)


def _labelled(text: str, tools: list[Tool], registry: Registry, what: str) -> LabelledQuery:
    return LabelledQuery(text, tuple(tool.name for tool in tools),
                         where=f"{registry.source or registry.name}: composed ({what})")


__all__ = ["composed_examples", "task", "with_arguments"]
