"""A request cut into its asks (``tooltrie/asks.py``): what users write when they ask for several things at once, a
single ask with its context kept whole, and bad input (a word, only connectives, hundreds of clauses)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tooltrie.asks import MAX_ASKS, split_asks

CUTS = [  # (request, its asks)
    ("What will the weather be in Paris tomorrow, and is there news about flights?",
     ["What will the weather be in Paris tomorrow", "is there news about flights?"]),
    ("Get the Q3 revenue per room for the Lisbon hotel, then check whether amy_83 may open the finance dashboard, "
     "and export the chart as a PDF.",
     ["Get the Q3 revenue per room for the Lisbon hotel", "check whether amy_83 may open the finance dashboard",
      "export the chart as a PDF."]),
    ("1) convert 100 USD to EUR 2) the weather in Oslo 3) book a taxi",
     ["convert 100 USD to EUR", "the weather in Oslo", "book a taxi"]),
    ("First, find a flight to Rome; second, book a hotel there.", ["find a flight to Rome", "book a hotel there."]),
    ("find the film called Arrival; and show me the popular movies",
     ["find the film called Arrival", "show me the popular movies"]),
    ("Movie 680: its images, the movies similar to it, and its keywords",
     ["Movie 680: its images", "the movies similar to it", "its keywords"]),
    ("Translate this to French. After that, email it to Anna.",
     ["Translate this to French.", "email it to Anna."]),
]
WHOLE = [  # one ask each: context, a noun phrase joined by "and", a list of places
    "I'm flying to Rome on Friday. What's the weather there?",
    "Show me the stock's price and the company's latest news",
    "What's the weather in Paris, Rome and Oslo this weekend?",
    "Find the cast and crew of movie 550",
    "Vocabulary test in Spanish on Friday, 200 words. I want to drill them a few minutes a day.",
]


@pytest.mark.parametrize(("request_text", "expected"), CUTS)
def test_each_ask_is_cut_out(request_text: str, expected: list[str]) -> None:
    assert split_asks(request_text) == expected


@pytest.mark.parametrize("request_text", WHOLE)
def test_a_single_ask_with_its_context_stays_whole(request_text: str) -> None:
    assert split_asks(request_text) == [request_text]


@pytest.mark.parametrize(("request_text", "expected"), [
    ("weather", ["weather"]), ("", [""]), ("   ", [""]), ("and then, also", ["and then, also"]),
    ("then also; and then.", ["then also; and then."]), ("?!", ["?!"])])
def test_bad_input_is_one_ask(request_text: str, expected: list[str]) -> None:
    assert split_asks(request_text) == expected


def test_hundreds_of_clauses_make_at_most_the_limit() -> None:
    text = " ".join(f"Find item {i}." for i in range(200))
    asks = split_asks(text)
    assert len(asks) == MAX_ASKS and asks[:2] == ["Find item 0.", "Find item 1."]
    assert _words(" ".join(asks)) == _words(text)


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9_']+", text.lower())


# The words of a request, in order: what a cut may drop is punctuation, connectives and list markers.
DROPPED = {"and", "then", "after", "that", "afterwards", "also", "as", "well", "additionally", "plus", "next",
           "finally", "lastly", "first", "firstly", "second", "secondly", "third", "thirdly", "fourth", "fifth",
           "last", "oh", "but", "or", *map(str, range(100)), *"abcdefgh"}
PIECES = st.sampled_from(["find a hotel", "and", "then", "the weather in Oslo", ", and", ".", "?", "1)", "also",
                          "book a table", "I'm in Rome", ";", "its keywords", ", the cast", "what is", "\n", "-"])


@given(st.lists(PIECES, max_size=30).map(" ".join))
def test_a_cut_keeps_the_requests_words_in_order(text: str) -> None:
    asks = split_asks(text)
    assert 1 <= len(asks) <= MAX_ASKS
    kept = [word for word in _words(text) if word not in DROPPED]
    assert [word for word in _words(" ".join(asks)) if word not in DROPPED] == kept
