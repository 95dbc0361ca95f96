"""Which tools a request names (``registry/named.py``): every tool of the five development registries is found by
its name in each spelling a request may write it (as written, any case, snake_case, camelCase, words, ``select:``),
first unless the spelling is another tool's too; identifiers inside a request are found in order; plain words are
not names; an unknown ``select:`` name is an error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tooltrie.eval.datasets import registry_path
from tooltrie.registry import load_registry, make_registry
from tooltrie.registry.named import SELECT, NameIndex, UnknownToolNameError, name_words, spellings

DEVELOPMENT = ("metatool-single", "bfcl", "restbench-tmdb", "restbench-spotify", "toolalpaca")


@pytest.mark.parametrize("dataset", DEVELOPMENT)
def test_every_tool_is_found_by_its_name_in_every_spelling(dataset: str) -> None:
    registry = load_registry(registry_path(dataset))
    index = NameIndex(registry)
    shared = 0
    for i, name in enumerate(registry.names):
        for form, text in {**spellings(name), "upper case": name.upper(), "select": SELECT + name}.items():
            named = index.named(text)
            exactly = registry.by_name.get(text.removeprefix(SELECT))
            assert i in named or exactly not in (None, i), (name, form, text)  # or another tool is written so
            if named[0] != i:  # only where the spelling is another tool's own name, or both tools' spelling
                spelled = text.removeprefix(SELECT)
                other = registry.names[named[0]]
                assert other == spelled or name_words(other) == name_words(spelled) or (
                    "".join(name_words(other)) == "".join(name_words(spelled))), (name, form, text, other)
                shared += 1
    assert shared <= len(registry) // 10  # a few, where a registry has two spellings of one name (BFCL)


def test_identifiers_inside_a_request_are_found_in_order_and_plain_words_are_not() -> None:
    registry = make_registry([{"name": n} for n in ("get_weather", "sendEmail", "news", "weather.get_forecast")],
                             name="r")
    index = NameIndex(registry)
    assert index.named("first sendEmail, then call get_weather for Oslo") == [1, 0]
    assert index.named("use `weather.get_forecast`.") == [3]
    assert index.named("what is the weather and the news") == []  # words, not names
    assert index.named("News") == [2] and index.named("send email") == [1] and index.named("GET-WEATHER") == [0]
    assert index.named("select:news, get_weather") == [2, 0]
    with pytest.raises(UnknownToolNameError, match=r"select: names 'nope', which registry 'r' does not have"):
        index.named("select:news,nope")
    with pytest.raises(UnknownToolNameError, match="no tool"):
        index.named("select:")


def test_the_tool_written_exactly_so_is_meant_where_two_share_a_spelling() -> None:
    registry = make_registry([{"name": "get_user"}, {"name": "getUser"}], name="r")
    index = NameIndex(registry)
    assert index.named("getUser") == [1] and index.named("get_user") == [0]
    assert index.named("get user") == [0, 1]  # both meant: the registry's order


@given(st.lists(st.from_regex(r"[a-z]{2,6}", fullmatch=True), min_size=1, max_size=4, unique=True))
def test_the_four_spellings_name_the_same_tool(words: list[str]) -> None:
    name = "_".join(words)
    registry = make_registry([{"name": name}, {"name": "zz_other_tool"}], name="r")
    index = NameIndex(registry)
    for text in spellings(name).values():
        assert index.named(text)[0] == 0, text
