"""A request cut into its asks: "Get the Q3 revenue per room for the Lisbon hotel, then check whether amy_83 may open
the finance dashboard, and export the chart as a PDF" asks three things, each for its own tool.

A request's embedding and its words are dominated by its first ask, so a prior made from the whole request answers
the first ask and then its near-duplicates; a prior made from each ask answers each (``docs/benchmarks.md``). The cut
is made with words only, in three passes:

1. **sentences and enumerations**: ``.``, ``?``, ``!`` and ``;`` before a new sentence, line breaks, and list markers
   (``1)``, ``2.``, ``(a)``, ``- ``, "first,", "second,", ...);
2. **connectives**: "then", "after that", "afterwards", "also", "plus", "additionally", "as well as", "next",
   "finally", "lastly" where they join two clauses (after a comma, or "and then", "and also");
3. **"and" between verb phrases**: "..., and is there news about flights?", "find a hotel and book a table": "and"
   (or a comma) followed by a word that starts a request (a verb of asking or doing, a question word, "can you", "I
   need"). "The stock's price and the company's news" (nouns) stays one ask.

A sentence that asks nothing (no question mark, no request word first: "I'm flying to Rome on Friday.") is context:
it joins the ask after it (at the end, the one before), so a single ask with context stays whole. At most ``MAX_ASKS``;
past that the rest stays with the last ask.

>>> split_asks("What will the weather be in Paris tomorrow, and is there news about flights?")
['What will the weather be in Paris tomorrow', 'is there news about flights?']
>>> split_asks("I'm flying to Rome on Friday. What's the weather there? Also find me a hotel near the Colosseum.")
["I'm flying to Rome on Friday. What's the weather there?", 'find me a hotel near the Colosseum.']
>>> split_asks("Show me the stock's price and the company's latest news")
["Show me the stock's price and the company's latest news"]
"""

from __future__ import annotations

import re
from collections.abc import Callable

MAX_ASKS = 8  # an answer of more tools than this is rare; a longer request keeps its tail in its last ask

# Words that start a request: verbs of asking or doing, question words, and the ways users open a request.
REQUEST_WORDS = frozenset("""
add analyse analyze ask book buy calculate cancel check compare compute convert count create delete describe
design detect download draft draw email estimate explain export fetch figure find generate get give grab help
identify list locate look make map measure monitor notify open order pay pick plan play post predict pull
recommend register remind remove rename reserve retrieve run save schedule search see send set share show sign
start stop subscribe suggest summarize summarise tell track translate turn update upload verify write what
what's whats which who who's whom whose when where where's why how how's is are was were do does did can could
would will should may might shall
""".split())  # noqa: SIM905 (a word list reads best as text)
OPENERS = ("i need", "i want", "i'd like", "i would like", "i'm looking for", "i am looking for", "please", "let me",
           "can you", "could you", "would you", "will you")
CONNECTIVES = ("after that", "afterwards", "and then", "and also", "as well as", "additionally", "also", "then", "plus",
               "next", "finally", "lastly")
ORDINALS = ("first", "firstly", "second", "secondly", "third", "thirdly", "fourth", "fifth", "last")

_JOINING = frozenset(" ".join((*CONNECTIVES, *ORDINALS, "and but oh or")).split())
_SENTENCE = re.compile(r"(?<=[.?!;])\s+(?=\S)|\n+")
_ENUMERATION = re.compile(r"(?:^|\s)(?:\(?\d{1,2}[.)]|\([a-h]\)|[a-h]\)|[-*\u2022])\s+")
_CONNECTIVE = re.compile(r"(?:^|,\s*|\s+and\s+|;\s*)(?:" + "|".join(c.replace(" ", r"\s+") for c in CONNECTIVES)
                         + r")\b[,:]?\s*", re.IGNORECASE)
_ORDINAL = re.compile(r"(?:^|[,;]\s*|\s+and\s+)(?:" + "|".join(ORDINALS) + r")\b,?\s*", re.IGNORECASE)
_LEADING = re.compile(r"^(?:oh,?\s+)?(?:and|but)\s+", re.IGNORECASE)  # "... Arrival; and show me ..."
# A list of asks named as noun phrases: "its details, the cast of season 5, and whatever keywords it has". Cut at a
# comma (or the list's last ", and") before a determiner, possessive or question word, and only in a list of three or
# more (a comma and a final ", and"): "Paris, Rome and Oslo" stays whole, "the cast and crew" too.
LIST_STARTS = ("the", "its", "their", "his", "her", "my", "our", "your", "any", "whatever", "a", "an", "who", "what",
               "which", "how", "when", "where", "whether")
_LIST_CUT = re.compile(r",\s*(?:and\s+|or\s+)?(?=(?:" + "|".join(LIST_STARTS) + r")\b)", re.IGNORECASE)
_AND = re.compile(r"(?:,\s*and|,|\s+and)\s+(?=\S)", re.IGNORECASE)
_WORD = re.compile(r"[A-Za-z']+")


def split_asks(text: str) -> list[str]:
    """The asks of a request, in order; one ask (the request, stripped) when it asks one thing. Every word of the
    request is in exactly one ask, in its order.

    >>> split_asks("1) convert 100 USD to EUR 2) the weather in Oslo 3) book a taxi")
    ['convert 100 USD to EUR', 'the weather in Oslo', 'book a taxi']
    >>> split_asks("Find a hotel in Lisbon and book a table for two at eight")
    ['Find a hotel in Lisbon', 'book a table for two at eight']
    """
    result: list[str] = []
    context: list[str] = []
    for sentence in _sentences(text):
        pieces = [sentence]
        for cut in (_enumeration, _connectives, _ordinals, _verb_phrases, _list_items):
            pieces = [part for piece in pieces for part in cut(piece)]
        pieces = [piece for piece in pieces if _content(piece)]  # a connective alone asks nothing
        if not pieces:
            continue
        if pieces == [sentence] and not asks(sentence):  # context: nothing cut it, it asks nothing
            context.append(sentence)
            continue
        pieces[0] = " ".join([*context, pieces[0]])
        context = []
        result += pieces
    if context:  # context after the last ask belongs to it
        result = [*result[:-1], " ".join(result[-1:] + context)]
    if len(result) > MAX_ASKS:
        result = [*result[: MAX_ASKS - 1], " ".join(result[MAX_ASKS - 1:])]
    return result or [text.strip()]


def _content(piece: str) -> bool:
    """Whether ``piece`` holds a word that is not a connective, an ordinal or a list marker."""
    return any(word not in _JOINING for word in _WORD.findall(piece.lower()))


def _clean(piece: str) -> str:
    return piece.strip(" ,;:\t\n")


def _cut(pattern: re.Pattern[str]) -> Callable[[str], list[str]]:
    """A cut at ``pattern``'s matches, the pieces cleaned and the empty ones dropped."""
    return lambda text: [part for part in map(_clean, pattern.split(text)) if part]


_sentences, _enumeration, _ordinals = _cut(_SENTENCE), _cut(_ENUMERATION), _cut(_ORDINAL)


def _connectives(text: str) -> list[str]:
    return _cut(_CONNECTIVE)(_LEADING.sub("", text))


def _list_items(text: str) -> list[str]:
    """A list of three or more asks named as noun phrases (``_LIST_CUT``), cut into its items."""
    parts = _LIST_CUT.split(text)
    if len(parts) < 3 or not re.search(r",\s*(?:and|or)\s", text, re.IGNORECASE):
        return [text]
    return [part for part in map(_clean, parts) if part]


def _verb_phrases(text: str) -> list[str]:
    """Cut at "and" or a comma followed by a request's first word (:func:`asks`), never inside a noun phrase."""
    parts, start = [], 0
    for match in _AND.finditer(text):
        if match.start() > start and opens_request(text[match.end():]) and _has_words(text[start:match.start()], 2):
            parts.append(text[start:match.start()])
            start = match.end()
    parts.append(text[start:])
    return [part for part in map(_clean, parts) if part]


def asks(piece: str) -> bool:
    """Whether ``piece`` asks something: a question, or a request's first word (:func:`opens_request`).

    >>> asks("is there news about flights?"), asks("the company's latest news"), asks("I'm flying on Friday.")
    (True, False, False)
    """
    return piece.strip().endswith("?") or opens_request(piece)


def opens_request(piece: str) -> bool:
    """Whether ``piece`` starts as a request does: a verb of asking or doing, a question word, or an opener ("can
    you", "I need").

    >>> opens_request("book a table"), opens_request("keyword?"), opens_request("I need a hotel")
    (True, False, True)
    """
    lowered = piece.strip().lower()
    if lowered.startswith(OPENERS):
        return True
    first = _WORD.match(lowered)
    return first is not None and first.group() in REQUEST_WORDS


def _has_words(piece: str, count: int) -> bool:
    return len(_WORD.findall(piece)) >= count


__all__ = ["MAX_ASKS", "asks", "opens_request", "split_asks"]
