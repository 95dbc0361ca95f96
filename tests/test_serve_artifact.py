"""Serving what ``tooltrie compile`` makes: a registry whose names contain ", " compiled with another separator, served
from the artifact (and from the registry file with ``separator``), answering ``/v1/discover`` with the names intact.
The real server on a loopback port with the tiny random Llama; no network beyond loopback."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from support.serve_http import check_answer, running_server, smollm_tokenizer, tiny_service

from tooltrie.cli import main
from tooltrie.compiler import Artifact
from tooltrie.compiler.sources import artifact_from, is_artifact, registry_of
from tooltrie.errors import ArtifactMismatchError, RegistryError
from tooltrie.registry import load_registry
from tooltrie.serve.service import DiscoveryService
from tooltrie.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("loopback_only")

TOOLS = [("search, then summarize", "search the web and summarize the results"),
         ("get_weather", "the weather forecast for a city"),
         ("translate, detect language", "detect a text's language and translate it"),
         ("send_email", "send an email to a contact"),
         ("book, pay, confirm", "book a hotel room, pay and confirm")]


@pytest.fixture(scope="module")
def comma_registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("registries") / "commas.yaml"
    path.write_text(yaml.safe_dump({"name": "commas", "tools": [{"name": name, "description": about}
                                                                 for name, about in TOOLS]}), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def comma_artifact(comma_registry: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "commas.trie.safetensors"
    assert main(["compile", str(comma_registry), "--separator", r"\n", "-o", str(out)]) == 0
    return out


def test_the_default_separator_refuses_the_names_and_proposes_one(comma_registry: Path) -> None:
    with pytest.raises(RegistryError, match=r"(?s)names containing the separator \(3\).*--separator '\\n'"):
        artifact_from(comma_registry, smollm_tokenizer())


def test_the_artifact_is_recognised_and_holds_its_registry_and_contract(comma_registry: Path,
                                                                         comma_artifact: Path) -> None:
    assert is_artifact(comma_artifact) and not is_artifact(comma_registry)
    assert registry_of(comma_artifact) == load_registry(comma_registry)
    artifact = artifact_from(comma_artifact, smollm_tokenizer())
    assert artifact.contract.separator == "\n"
    # The same artifact from the registry file, given the separator.
    assert artifact_from(comma_registry, smollm_tokenizer(), separator="\n").sha256 == artifact.sha256
    with pytest.raises(ArtifactMismatchError, match="contract"):  # an artifact keeps its own separator
        artifact_from(comma_artifact, smollm_tokenizer(), separator="; ")


def _discover_all(service: DiscoveryService) -> list[dict[str, object]]:
    bodies = []
    with running_server(service) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        for query, k in [("what is the weather in Paris?", 1), ("search the news, then translate it", 3),
                         ("book a room", 5)]:
            reply = client.post("/v1/discover", json={"query": query, "k": k})
            assert reply.status_code == 200, reply.text
            bodies.append(reply.json())
        registries = client.get("/v1/registries").json()["registries"]
    assert [summary["name"] for summary in registries] == ["commas"]
    return bodies


@pytest.mark.parametrize("source", ["artifact", "registry-with-separator"])
def test_serving_names_that_contain_the_default_separator(source: str, comma_registry: Path, comma_artifact: Path,
                                                          tmp_path: Path) -> None:
    registry = load_registry(comma_registry)
    if source == "artifact":
        service = tiny_service([comma_artifact], tmp_path / "cache")
    else:
        service = DiscoveryService.from_paths([comma_registry], tiny_llama(), smollm_tokenizer(),
                                              cache_dir=tmp_path / "cache", separator="\n")
    assert service.served("commas").artifact.contract.separator == "\n"
    bodies = _discover_all(service)
    for body, k in zip(bodies, (1, 3, 5), strict=True):
        check_answer(body, registry, k)
    answered = {tool["name"] for body in bodies for tool in body["tools"]}  # type: ignore[attr-defined]
    assert {name for name, _ in TOOLS if ", " in name} <= answered  # k = 5 names every tool, commas intact


def test_the_prompt_lists_the_artifacts_separator(comma_artifact: Path) -> None:
    from tooltrie.serve.prompt import Prompt

    artifact = Artifact.load(comma_artifact)
    prefix, _ = Prompt().parts(artifact.registry, artifact.contract, 2)
    assert 'separated by "\n"' in prefix and 'separated by ", "' not in prefix
