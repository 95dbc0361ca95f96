"""Per-request subsets in the engine: ``allow``/``deny`` limit the answer, with the same model and no recompiling.

With the short prompt (no catalog in it) the model sees the same tokens whichever registry is compiled, so an
answer limited to a subset must equal the answer under a registry compiled from that subset alone.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.serve import tiny_model

from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.errors import DecodeError, RegistryError
from tooltrie.registry import CATALOG_PATH, load_registry, make_registry
from tooltrie.serve.engine import Engine, Request
from tooltrie.serve.prompt import Prompt

SHORT = Prompt.style("short")
QUERIES = ("What's the weather in Paris?", "latest news on Mars", "convert 10 USD to EUR", "find me a job")


@pytest.fixture(scope="module")
def smollm() -> TokenizerInfo:
    return TokenizerInfo.load("smollm2-135m")


@pytest.fixture(scope="module")
def catalog(smollm: TokenizerInfo) -> Artifact:
    return compile_registry(load_registry(CATALOG_PATH), smollm)


@pytest.fixture(scope="module")
def engine(catalog: Artifact, smollm: TokenizerInfo) -> Engine:
    return Engine(tiny_model(), smollm, catalog, max_batch=8, prompt=SHORT)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.integers(0, 46), min_size=3, max_size=8, unique=True), k=st.integers(1, 3),
       query=st.sampled_from(QUERIES))
def test_a_subset_answers_as_the_registry_compiled_from_it(engine: Engine, catalog: Artifact, smollm: TokenizerInfo,
                                                           picks: list[int], k: int, query: str) -> None:
    tools = [catalog.registry.tools[i] for i in sorted(picks)]
    limited = engine.run([Request(query, k, allow=tuple(t.name for t in tools))])[0]
    alone_artifact = compile_registry(make_registry([{"name": t.name} for t in tools], name="alone"), smollm)
    alone = Engine(tiny_model(), smollm, alone_artifact, prompt=SHORT).run([Request(query, k)])[0]
    assert limited.finish_reason == alone.finish_reason == "stop"
    assert limited.token_ids == alone.token_ids
    assert [t.name for t in limited.tools] == [t.name for t in alone.tools]
    assert len({t.name for t in limited.tools}) == k and {t.name for t in limited.tools} <= {t.name for t in tools}


def test_deny_removes_tools_and_mixed_requests_share_a_batch(engine: Engine, catalog: Artifact) -> None:
    names = catalog.registry.names
    plain = engine.run([Request(q, 2) for q in QUERIES])
    denied = tuple(t.name for answer in plain for t in answer.tools)
    requests = [Request(q, 2, deny=denied) for q in QUERIES] + [Request(q, 2) for q in QUERIES]
    mixed = engine.run(requests)
    for answer in mixed[: len(QUERIES)]:
        assert answer.finish_reason == "stop"
        assert not {t.name for t in answer.tools} & set(denied)
        assert {t.name for t in answer.tools} <= set(names)
    for got, want in zip(mixed[len(QUERIES):], plain, strict=True):  # neighbours with subsets change nothing
        assert got.token_ids == want.token_ids


@pytest.mark.parametrize(("request_", "error", "message"), [
    (Request("q", 3, allow=("FinanceTool", "NewsTool")), DecodeError, "k=3 but only 2 tools are allowed"),
    (Request("q", 1, allow=()), DecodeError, "k=1 but only 0 tools are allowed"),
    (Request("q", 1, allow=("NoSuchTool",)), RegistryError, "allow names 'NoSuchTool', which is neither"),
    (Request("q", 1, deny=("nope",)), RegistryError, "deny names 'nope'"),
])
def test_impossible_subsets_are_refused_at_submit(engine: Engine, request_: Request, error: type[Exception],
                                                  message: str) -> None:
    with pytest.raises(error, match=message):
        engine.submit(request_)
    assert not engine.busy


def test_a_subset_of_k_tools_is_the_answer(engine: Engine) -> None:
    allow = ("NewsTool", "FinanceTool", "WeatherTool")
    answer: Any = engine.run([Request("anything at all", 3, allow=allow)])[0]
    assert answer.finish_reason == "stop"
    assert sorted(t.name for t in answer.tools) == sorted(allow)
