"""Hard negatives (``train/hard_negatives.py``) against brute force: each tool's partner is the other tool whose
embedded text has the highest cosine with its own, ties to the tool listed first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from support.encoders import MadeUpEncoder

from tooltrie.registry import make_registry
from tooltrie.retrieval import tool_text
from tooltrie.train.hard_negatives import confused_tools


@settings(deadline=None, max_examples=50)
@given(names=st.lists(st.from_regex(r"[a-z]{1,6}", fullmatch=True), min_size=2, max_size=12, unique=True))
def test_each_tool_is_paired_with_the_nearest_other_tool(names: list[str]) -> None:
    registry = make_registry([{"name": name} for name in names], name="tools")
    vectors = MadeUpEncoder(8, distinct=4).encode([tool_text(tool) for tool in registry.tools]).double()
    expected = {}
    for i, name in enumerate(registry.names):
        similarity = [float(vectors[i] @ vectors[j]) if j != i else -2.0 for j in range(len(names))]
        best = max(similarity)
        expected[name] = registry.names[next(j for j, s in enumerate(similarity) if s >= best - 1e-6)]
    assert confused_tools(registry, encoder=MadeUpEncoder(8, distinct=4)) == expected  # type: ignore[arg-type]


def test_a_registry_of_one_tool_has_no_hard_negatives() -> None:
    one = make_registry([{"name": "only"}], name="one")
    assert confused_tools(one, encoder=MadeUpEncoder(8, distinct=4)) == {}  # type: ignore[arg-type]
