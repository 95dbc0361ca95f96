"""Chains (``tooltrie/chains.py``): which tool finds the identifier another tool requires.

- the two REST registries (RestBench's TMDB and Spotify, bundled): each tool's needed entities and each entity's
  finders, as read by hand from their parameters;
- ``wanted`` against a brute force over every tool, for random chosen tools of random registries (hypothesis);
- the follow-up: after a chosen tool the prior is the one without chains plus ``chain_weight`` on exactly the wanted
  tools; a registry without identifiers follows as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.encoders import MadeUpEncoder

from tooltrie.chains import Chains, needed, searches, singular
from tooltrie.eval.datasets import registry_path
from tooltrie.lexical import STOPWORDS, identifier_words
from tooltrie.ranker import FOLLOW, FollowUp, Ranker, Weights
from tooltrie.registry import CATALOG_PATH, Registry, load_registry, make_registry

pytest.importorskip("bm25s", reason="the lexical prior needs bm25s (the model extra)")


def names(registry: Registry, tools: Iterable[int]) -> list[str]:
    return [registry.names[t] for t in tools]


def test_the_tmdb_registry_chains_a_search_before_each_lookup_by_id() -> None:
    tmdb = load_registry(registry_path("restbench-tmdb"))
    chains = Chains.of(tmdb)
    tool = tmdb.names.index
    # required: movie_id / person_id / tv_id (+ season and episode numbers, not ids) / credit_id; none
    assert chains.needs[tool("get_movie_credits")] == {"movie"}
    assert chains.needs[tool("get_person_movie_credits")] == {"person"}
    assert chains.needs[tool("get_tv_season_episode_credits")] == {"tv"}
    assert chains.needs[tool("get_credit")] == {"credit"}
    assert chains.needs[tool("get_trending")] == frozenset() == chains.needs[tool("get_search_movie")]
    # the five search operations, each requiring a query; nothing finds a credit, a review or a network by text
    assert {entity: names(tmdb, found) for entity, found in chains.finders.items()} == {
        "movie": ["get_search_movie"], "tv": ["get_search_tv"], "person": ["get_search_person"],
        "company": ["get_search_company"], "collection": ["get_search_collection"]}
    assert names(tmdb, chains.wanted((tool("get_movie_credits"),))) == ["get_search_movie"]
    assert names(tmdb, chains.wanted((tool("get_movie_credits"), tool("get_person")))) == [
        "get_search_movie", "get_search_person"]  # ascending tool ids
    assert chains.wanted((tool("get_movie_credits"), tool("get_search_movie"))).size == 0  # found already
    assert chains.wanted((tool("get_review"),)).size == 0  # nothing finds it
    assert Chains.of(tmdb) is chains  # made once per registry version


def test_spotify_takes_a_bare_id_from_the_tools_name() -> None:
    spotify = load_registry(registry_path("restbench-spotify"))
    chains = Chains.of(spotify)
    tool = spotify.names.index
    assert chains.needs[tool("get_albums_tracks")] == {"album"}  # `id`: the first entity its name holds
    assert chains.needs[tool("get_artists_top_tracks")] == {"artist"}
    assert chains.needs[tool("delete_me_tracks")] == {"track"}  # `ids`: the last
    assert chains.needs[tool("post_users_playlists")] == {"user"}  # user_id (and a name, not an id)
    assert chains.needs[tool("get_me_top")] == frozenset()  # `type` only
    # get_search requires q and type; its description lists albums, artists, playlists, tracks
    assert {entity: names(spotify, found) for entity, found in chains.finders.items()} == {
        entity: ["get_search"] for entity in ("album", "artist", "playlist", "track")}


def test_parameters_that_are_not_required_identifiers_need_nothing() -> None:
    registry = make_registry([
        {"name": "get_order", "parameters": {"type": "object", "properties": {"orderId": {"type": "string"}}}},
        {"name": "ship", "parameters": {"type": "object", "required": ["orderId", "ident", "identity"], "properties": {
            "orderId": {"type": "string"}, "ident": {"type": "string"}, "identity": {"type": "string"}}}},
        {"name": "lookup", "description": "Find an order.", "parameters": {
            "type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}}},
        {"name": "search_orders", "description": "Orders by date."},
        {"name": "find_by_order", "description": "Find an order.", "parameters": {
            "type": "object", "required": ["q", "order_id"], "properties": {
                "q": {"type": "string"}, "order_id": {"type": "string"}}}}], name="orders")
    chains = Chains.of(registry)
    assert [set(n) for n in chains.needs] == [set(), {"order"}, set(), set(), {"order"}]  # optional id: nothing
    assert [searches(tool) for tool in registry.tools] == [False, False, True, True, True]
    assert names(registry, chains.finders["order"]) == ["lookup", "search_orders"]  # not the one that needs it


tools_strategy = st.lists(st.tuples(
    st.sampled_from(["get_movie", "search_movie", "find_person", "list_tracks", "movie_credits", "lookup"]),
    st.sampled_from(["", "Search for movies.", "People and their tracks.", "Find a person."]),
    st.lists(st.tuples(st.sampled_from(["movie_id", "personId", "id", "ids", "query", "q", "page", "track_ids"]),
                       st.booleans()), max_size=3, unique_by=lambda p: p[0])), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(tools=tools_strategy, data=st.data())
def test_wanted_is_every_finder_of_what_the_chosen_need_and_none_of_them_finds(tools: list[Any],
                                                                                data: st.DataObject) -> None:
    registry = make_registry([{"name": f"{name}_{i}", "description": description, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p, _ in params},
        "required": [p for p, required in params if required]}} for i, (name, description, params) in enumerate(tools)],
        name="made")
    chains = Chains.build(registry.tools)
    chosen = tuple(data.draw(st.lists(st.integers(0, len(registry) - 1), min_size=1, max_size=3, unique=True)))

    def words(text: str) -> set[str]:
        return {singular(w) for w in identifier_words(text) if w not in STOPWORDS}

    def finds(u: int, entity: str) -> bool:
        tool = registry.tools[u]
        return searches(tool) and entity in words(f"{tool.name} {tool.description}") and entity not in needed(tool)

    expected = set()
    for entity in set().union(*(needed(registry.tools[t]) for t in chosen)):
        finders = {u for u in range(len(registry)) if finds(u, entity)}
        if not finders & set(chosen):
            expected |= finders
    assert chains.wanted(chosen).tolist() == sorted(expected)


def test_the_follow_up_adds_the_chain_weight_to_exactly_the_wanted_tools() -> None:
    tmdb = load_registry(registry_path("restbench-tmdb"))
    made = Ranker(tmdb, fused=Weights(model=1.0, retrieval=10.0), encoder=MadeUpEncoder()).row(
        "Who starred in Titanic?", "fused")
    follow = made.follow
    assert follow is not None and follow.chains is Chains.of(tmdb)
    assert follow.chain_weight == 10.0 * FOLLOW["chains"]  # in the weighted prior's units
    without = FollowUp(follow.first, follow.query, follow.index, follow.tools, follow.lexical_weight,
                       follow.later_weight, follow.covered)
    credits, search = tmdb.names.index("get_movie_credits"), tmdb.names.index("get_search_movie")
    bonus = follow((credits,)) - without((credits,))
    np.testing.assert_allclose(bonus, np.where(np.arange(len(tmdb)) == search, follow.chain_weight, 0.0), atol=1e-4)
    np.testing.assert_array_equal(follow((credits, search)), without((credits, search)))  # found: no bonus
    assert follow(()) is made.scores  # the first tool's prior is the request's own


def test_a_registry_without_identifiers_follows_as_before() -> None:
    catalog = load_registry(CATALOG_PATH)
    assert Chains.of(catalog).finders == {} and not any(Chains.of(catalog).needs)
    follow = Ranker(catalog, encoder=MadeUpEncoder()).row("weather and news", "fused").follow
    assert follow is not None
    without = FollowUp(follow.first, follow.query, follow.index, follow.tools, follow.lexical_weight,
                       follow.later_weight, follow.covered)
    for tools in ((0,), (3, 9), (46, 1, 2)):
        np.testing.assert_array_equal(follow(tools), without(tools))
