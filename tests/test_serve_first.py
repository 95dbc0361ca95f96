"""Named and pinned tools (``serve/first.py``) through the discovery service: a request that names a tool gets it
first at every k, pinned tools are always in the answer (within k, or on top of it), and the rest of the answer is
exactly what the decode gives for the remaining count without those tools (a differential check), so every answer
still has distinct tools and exactly the promised count. Bad pins and unknown ``select:`` names are refused; a
tenant's pins come from its policy. The model is the tiny random Llama; the registry the catalog."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.serve_http import catalog, tiny_service

from tooltrie.registry import CATALOG_PATH
from tooltrie.registry.named import spellings
from tooltrie.serve.errors import InvalidRequestError
from tooltrie.serve.policy import Policy, PolicyError
from tooltrie.serve.request import Request
from tooltrie.serve.service import DiscoveryService

QUERY = "I need the forecast for Oslo and a cheap flight there"
KEY = "a key of sixteen chars or more"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Any:
    served = tiny_service([CATALOG_PATH], tmp_path_factory.mktemp("cache"))
    served.start()
    yield served
    served.stop()


def discover(service: DiscoveryService, request: Request) -> dict[str, Any]:
    return asyncio.run(service.discover(request))


def names(body: dict[str, Any]) -> list[str]:
    return [tool["name"] for tool in body["tools"]]


@pytest.mark.parametrize("k", [1, 3])
def test_a_named_tool_comes_first_in_every_spelling(service: DiscoveryService, k: int) -> None:
    for name in ("WeatherTool", "TripTool", catalog().names[-1]):
        for text in (*spellings(name).values(), name.upper(), f"select:{name}"):
            body = discover(service, Request(text, k))
            assert names(body)[0] == name and body["tools"][0]["chosen_by"] == "named", (text, body)
            assert len(set(names(body))) == k == len(body["tools"])


def test_a_request_naming_two_tools_gets_both_in_its_order(service: DiscoveryService) -> None:
    text = "compare what NewsTool and WeatherTool say about Oslo"
    assert names(discover(service, Request(text, 3)))[:2] == ["NewsTool", "WeatherTool"]
    assert names(discover(service, Request(text, 1))) == ["NewsTool"]  # k=1: the first named


def test_select_of_a_tool_that_is_not_there_or_not_allowed_is_refused_alike(service: DiscoveryService) -> None:
    with pytest.raises(InvalidRequestError, match="'NoSuchTool', which registry 'catalog' does not have"):
        discover(service, Request("select:NoSuchTool", 1))
    with pytest.raises(InvalidRequestError, match="'NewsTool', which registry 'catalog' does not have"):
        discover(service, Request("select:NewsTool", 1, deny=("NewsTool",)))
    # a name merely written in a request, but denied, is not forced: the answer keeps out of it
    assert "NewsTool" not in names(discover(service, Request("what does NewsTool say", 2, deny=("NewsTool",))))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 4), pins=st.lists(st.sampled_from(["MapTool", "NewsTool", "TripTool", "BookTool",
                                                           catalog().names[-1]]), max_size=3, unique=True),
       within=st.booleans(), named=st.sampled_from([None, "MapTool", "TripTool"]))
def test_pins_and_names_then_exactly_the_decode_of_the_rest(service: DiscoveryService, k: int, pins: list[str],
                                                            within: bool, named: str | None) -> None:
    query = QUERY if named is None else f"{QUERY}, with {named}"
    if within and len(pins) > k:
        with pytest.raises(InvalidRequestError, match=f"{len(pins)} tools are pinned within k={k}"):
            discover(service, Request(query, k, pin=tuple(pins), pin_within_k=within))
        return
    body = discover(service, Request(query, k, pin=tuple(pins), pin_within_k=within))
    got = names(body)
    room = k - len(pins) if within else k  # for the named tool, unless it is pinned too
    named_first = [named] if named is not None and (named in pins or room > 0) else []
    pinned = [pin for pin in pins if pin not in named_first]
    first = named_first + pinned
    assert got[: len(first)] == first
    assert [tool["chosen_by"] for tool in body["tools"][: len(first)]] == ["named"] * len(named_first) + [
        "pinned"] * len(pinned)
    assert len(got) == len(set(got)) == (k if within else k + len(pinned))
    rest = len(got) - len(first)
    if rest:  # the decoded rest: the plain decode of that many tools without the first ones
        plain = discover(service, Request(query, rest, deny=tuple(first)))
        assert got[len(first):] == names(plain)
    assert [t["rank"] for t in body["tools"]] == list(range(1, len(got) + 1))


@pytest.mark.parametrize("within", [True, False])
def test_a_named_tool_that_is_pinned_too_counts_once(service: DiscoveryService, within: bool) -> None:
    body = discover(service, Request("what does MapTool show", 3, pin=("NewsTool", "MapTool"), pin_within_k=within))
    assert names(body)[:2] == ["MapTool", "NewsTool"] and len(set(names(body))) == len(body["tools"]) == (
        3 if within else 4)
    assert [tool["chosen_by"] for tool in body["tools"]][:2] == ["named", "pinned"]


def test_bad_pins_are_refused(service: DiscoveryService) -> None:
    with pytest.raises(InvalidRequestError, match="pin names 'Nope', which is not a tool of registry 'catalog'"):
        discover(service, Request(QUERY, 2, pin=("Nope",)))
    with pytest.raises(InvalidRequestError, match="pin names 'MapTool'"):  # not one the caller may use
        discover(service, Request(QUERY, 2, pin=("MapTool",), deny=("MapTool",)))
    with pytest.raises(InvalidRequestError, match="the answer needs 4 distinct tools"):
        discover(service, Request(QUERY, 2, pin=("MapTool", "NewsTool"), pin_within_k=False,
                                  allow=("MapTool", "NewsTool", "WeatherTool")))


def test_a_tenants_pins_come_from_its_policy(tmp_path: Path) -> None:
    grant = {"catalog": {"allow": ["WeatherTool", "NewsTool", "MapTool", "TripTool"], "pin": ["MapTool"]}}
    policy = Policy.parse({"tenants": {"acme": {"keys": [KEY], "registries": grant}}})
    service = tiny_service([CATALOG_PATH], tmp_path, policy=policy)
    tenant = policy.tenants["acme"]
    service.start()
    try:
        body = discover(service, Request(QUERY, 2, tenant=tenant))
        assert names(body)[0] == "MapTool" and body["tools"][0]["chosen_by"] == "pinned" and len(body["tools"]) == 2
        both = discover(service, Request(QUERY, 2, tenant=tenant, pin=("NewsTool",)))
        assert names(both) == ["MapTool", "NewsTool"]
    finally:
        service.stop()
    outside = {"catalog": {"allow": ["WeatherTool"], "pin": ["MapTool"]}}
    with pytest.raises(PolicyError, match=r"pin names \['MapTool'\], which are not tools the tenant may use"):
        tiny_service([CATALOG_PATH], tmp_path, policy=Policy.parse(
            {"tenants": {"acme": {"keys": [KEY], "registries": outside}}}))
