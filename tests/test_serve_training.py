"""Adapters trained while serving (``serve/training.py``): the cache key names everything an adapter depends on; a
server started with a trainer trains a registry's adapter in a child process while it answers, swaps it in under
load without losing a request, then answers as an engine with that adapter does; a restart finds it in the cache.

The base is the tiny random Llama saved as a directory, and the recipe a few steps long: the child process runs
the real data generation and training, in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from support.serve_http import catalog_tools, check_answer, running_server, smollm_tokenizer, write_registry

from tooltrie.compiler import compile_registry
from tooltrie.ranker import MODEL_ONLY, NO_ADAPTER, UNTRAINED, Weights
from tooltrie.ranker_policy import auto_ranker, fused_weights
from tooltrie.serve.adapter import read_adapter
from tooltrie.serve.engine import Engine
from tooltrie.serve.model import load_model
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.service import DiscoveryService, ServedRegistry
from tooltrie.serve.training import AdapterTrainer
from tooltrie.testing import tiny_llama
from tooltrie.train.recipe import Recipe

pytestmark = pytest.mark.usefixtures("loopback_only")

TINY = Recipe(compose=8, replay=None, steps=3, batch_size=2, rank=4, alpha=8, top_layers=1, learning_rate=0.05,
              warmup_steps=0)
QUERIES = ("What will the weather be in Paris tomorrow?", "Convert 100 US dollars to euros", "Play some jazz")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("base") / "tiny"
    tiny_llama().save_pretrained(path)
    return path


def test_the_cache_key_names_everything_an_adapter_depends_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The artifact, the base, the recipe, the training code's version and the replayed data's bytes."""
    import tooltrie.eval.datasets as datasets
    import tooltrie.train.recipe as recipe_module

    tokenizer = smollm_tokenizer()
    tools = [{"name": name, "description": about} for name, about in catalog_tools(0, 6)]
    artifact = compile_registry(_registry(tools), tokenizer)
    replaying = replace(TINY, replay="catalog")
    key, replayed_key = TINY.key(artifact, "f" * 64), replaying.key(artifact, "f" * 64)
    assert key == TINY.key(compile_registry(_registry(tools), tokenizer), "f" * 64)  # the same inputs
    changed = [TINY.key(compile_registry(_registry(tools[:-1]), tokenizer), "f" * 64),  # the tools
               TINY.key(artifact, "e" * 64),  # the base model
               replace(TINY, steps=4).key(artifact, "f" * 64),  # the recipe
               replace(TINY, fused=Weights(1.0, 50.0)).key(artifact, "f" * 64),
               replace(TINY, prior="lexical").key(artifact, "f" * 64)]
    # The replayed sets' content under the same names: one labelled request less.
    edited = tmp_path / "data"
    shutil.copytree(datasets.DATA_DIR, edited)
    single = edited / datasets.BUNDLED["metatool-single"].file
    single.write_text("".join(single.read_text(encoding="utf-8").splitlines(keepends=True)[1:]), encoding="utf-8")
    monkeypatch.setattr(datasets, "DATA_DIR", edited)
    recipe_module._replayed_content.cache_clear()
    changed.append(replaying.key(artifact, "f" * 64))
    # The training code.
    monkeypatch.setattr(recipe_module, "training_code_version", lambda: "0" * 64)
    changed.append(TINY.key(artifact, "f" * 64))
    recipe_module._replayed_content.cache_clear()
    assert len({key, replayed_key, *changed}) == 2 + len(changed)
    assert Recipe.from_json(TINY.to_json()) == TINY


def test_a_registry_reloaded_while_its_adapter_trains_is_trained_again(tmp_path: Path) -> None:
    """The version training finishes and is not swapped in (the service's ``_adopt`` asks again, as here); the
    reloaded version is queued meanwhile, its status shown, and trained next. A version still queued is dropped."""
    tokenizer = smollm_tokenizer()
    tools = [{"name": name, "description": about} for name, about in catalog_tools(0, 6)]
    first, second = (compile_registry(_registry(tools[:n]), tokenizer) for n in (6, 5))
    trainer = AdapterTrainer(job=TINY, base_model=None, base_fingerprint="f" * 64, cache_dir=tmp_path)
    trained: list[str] = []
    release = asyncio.Event()

    async def train(status: Any, artifact: Any) -> Any:
        status.state = "training"
        trained.append(artifact.sha256)
        await release.wait()
        return SimpleNamespace(path=tmp_path / artifact.sha256, artifact=artifact)

    adopted: list[str] = []

    async def ready(name: str, record: Any) -> None:
        if record.artifact.sha256 != current[0].sha256:  # as ``_adopt`` does when the registry changed
            trainer.request(name, current[0])
        else:
            adopted.append(record.artifact.sha256)

    trainer._train = train  # type: ignore[method-assign]
    trainer.request("r", first)
    trainer.request("r", second)  # not started yet: the first leaves the queue
    assert [entry[1].sha256 for entry in trainer._queue] == [second.sha256]
    trainer.request("r", first)
    current = [second]

    async def scenario() -> None:
        runner = asyncio.create_task(trainer.run(ready))
        while trainer.status["r"].state != "training":
            await asyncio.sleep(0.01)
        assert trained == [first.sha256]
        status = trainer.request("r", second)  # a reload while the first trains
        assert status.state == "queued" and trainer.request("r", second) is status
        release.set()
        while trainer.status["r"].state != "ready":
            await asyncio.sleep(0.01)
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner

    asyncio.run(scenario())
    assert trained == [first.sha256, second.sha256] and adopted == [second.sha256]
    assert trainer.status["r"].adapter == str(tmp_path / second.sha256)


def test_a_server_trains_an_adapter_and_swaps_it_in_under_load(tmp_path: Path, base_dir: Path) -> None:
    path = tmp_path / "tools.yaml"
    write_registry(path, "tools", catalog_tools(0, 12))
    base, info = load_model(base_dir, adapter=False)
    cache = tmp_path / "adapters"

    def service() -> DiscoveryService:
        trainer = AdapterTrainer(job=TINY, base_model=str(base_dir), base_fingerprint=info.fingerprint,
                                 cache_dir=cache)
        return DiscoveryService.from_paths([path], base, smollm_tokenizer(), cache_dir=tmp_path / "compiled",
                                           prompt=Prompt.style("short"), trainer=trainer)

    first = service()
    assert first.registries()[0]["training"]["state"] == "queued" and first.registries()[0]["adapter"] is None
    answered: list[tuple[bool, str, int, dict[str, Any]]] = []  # (sent after the swap, query, k, body)
    with running_server(first) as server:

        async def swapped(session: httpx.AsyncClient) -> bool:
            listing = (await session.get("/v1/registries")).json()["registries"][0]
            assert listing["training"]["state"] in ("queued", "training", "ready"), listing["training"]
            return bool(listing["training"]["state"] == "ready")

        async def asker(session: httpx.AsyncClient, client: int) -> None:
            after, i = 0, 0
            while after < 2:  # until the adapter is in, then two more
                done = await swapped(session)
                query, k = QUERIES[i % len(QUERIES)], 1 + (client + i) % 3
                reply = await session.post("/v1/discover", json={"query": query, "k": k})
                assert reply.status_code == 200, reply.text
                answered.append((done, query, k, reply.json()))
                after, i = after + done, i + 1

        async def load() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as session:
                await asyncio.wait_for(asyncio.gather(*(asker(session, c) for c in range(4))), 240)

        asyncio.run(load())
        artifact = first.served("tools").artifact
        with httpx.Client(base_url=server.url, timeout=60) as client:
            listing = client.get("/v1/registries").json()["registries"][0]
            metrics = client.get("/metrics").text
            again = client.post("/v1/registries/tools/train").json()  # in the cache: nothing is trained again
            write_registry(path, "tools", catalog_tools(0, 11))  # a tool less: the adapter no longer fits
            assert client.post("/v1/registries/tools/reload").status_code == 200
            changed = client.get("/v1/registries").json()["registries"][0]
    record = read_adapter(cache / TINY.key(artifact, info.fingerprint))
    assert listing["training"]["state"] == "ready" and listing["training"]["step"] == TINY.steps
    assert listing["adapter"] == {"path": str(record.path), "trained_on": "tools", "fits": True}
    assert again["state"] == "ready" and again["adapter"] == str(record.path)
    assert server.metric(metrics, "tooltrie_adapter_swaps_total", registry="tools") == 1
    assert server.metric(metrics, "tooltrie_adapter_training_steps", registry="tools") == TINY.steps
    # Nothing was measured for it: its record gives the recipe's weights, no ``auto``, and it answers fused at them.
    assert "auto" not in record.record["ranker"] and record.record["ranker"]["fused"] == TINY.fused.as_dict()
    assert "not measured" in record.record["ranker"]["fused_from"]
    assert auto_ranker(record, artifact, retrieval=True) == "fused" and fused_weights(record, artifact) == TINY.fused
    assert changed["adapter"] is None and changed["training"]["state"] in ("queued", "training")
    assert changed["tools"] == 11

    # Every request was answered; those sent after the swap, as an engine with the adapter answers them.
    assert sum(done for done, *_ in answered) >= 8
    tuned, untuned = (Engine(base, smollm_tokenizer(), artifact, prompt=Prompt.style("short"), adapter=adapter)
                      for adapter in (record, None))
    for done, query, k, body in answered:
        check_answer(body, artifact.registry, k)
        if done:
            assert _ranked(body) == pytest.approx(_ranked(tuned.answer(query, k).response()), abs=1e-3)
    assert any(_ranked(tuned.answer(query, 3).response()) != pytest.approx(
        _ranked(untuned.answer(query, 3).response()), abs=1e-2) for query in QUERIES)  # it was trained

    # A restart finds the adapter in the cache: nothing to train, the registry answered with it from the start.
    write_registry(path, "tools", catalog_tools(0, 12))
    second = service()
    assert second.served("tools").adapter is not None and second.served("tools").adapter.path == record.path
    assert second.registries()[0]["training"]["state"] == "ready"


RECORDS_AND_RANKERS = [  # (the record's ranker entry, what --ranker auto picks on its registry)
    ({"fused": {"model": 1.0, "retrieval": 100.0}, "fused_from": "a recipe"}, "fused"),  # nothing measured
    ({"fused": {"model": 1.0, "retrieval": 20.0}, "chosen_on": "validation", "auto": "model",
      "auto_chosen_on": "test"}, "model"),  # measured: the model alone ahead
    ({"fused": {"model": 1.0, "retrieval": 20.0}, "chosen_on": "validation", "auto": "fused"}, "fused"),
    ({}, "model"),  # nothing said at all: the model alone, as trained
]


@pytest.mark.parametrize(("ranker", "auto"), RECORDS_AND_RANKERS)
def test_an_adapter_trained_on_the_registry_ranks_as_its_record_says(tmp_path: Path, ranker: dict[str, Any],
                                                                     auto: str) -> None:
    """``auto`` follows what was measured for the adapter; unmeasured weights answer fused; elsewhere untrained."""
    tokenizer = smollm_tokenizer()
    artifact = compile_registry(_registry([{"name": n, "description": d} for n, d in catalog_tools(0, 6)]), tokenizer)
    other = compile_registry(_registry([{"name": n, "description": d} for n, d in catalog_tools(6, 12)]), tokenizer)
    record = _fake_record(tmp_path, artifact, ranker)
    assert auto_ranker(record, artifact, retrieval=True) == auto
    assert auto_ranker(record, artifact, retrieval=False) == "model"
    assert auto_ranker(record, other, retrieval=True) == "fused" and fused_weights(record, other) == UNTRAINED
    assert fused_weights(record, artifact) == (Weights(**ranker["fused"]) if "fused" in ranker else MODEL_ONLY)


def test_a_model_without_an_adapter_ranks_by_the_prior_alone() -> None:
    """The base model was never taught to choose tools: fused, it adds nothing to the prior (measured), so ``auto``
    is the prior's own ranking, or the model where no prior can be made."""
    artifact = compile_registry(_registry([{"name": n, "description": d} for n, d in catalog_tools(0, 6)]),
                                smollm_tokenizer())
    assert auto_ranker(None, artifact, retrieval=True) == "retrieval"
    assert auto_ranker(None, artifact, retrieval=False) == "model"
    assert fused_weights(None, artifact) == NO_ADAPTER


def test_a_registry_the_served_model_was_trained_on_is_not_trained_again(tmp_path: Path) -> None:
    """Its own adapter (labelled queries, say) knows the tools better than the registry's text alone would teach."""
    path = tmp_path / "tools.yaml"
    write_registry(path, "tools", catalog_tools(0, 6))
    other = tmp_path / "other.yaml"
    write_registry(other, "other", catalog_tools(6, 12))
    tokenizer = smollm_tokenizer()
    served = [ServedRegistry.load(file, tokenizer, Prompt(), cache_dir=tmp_path / "compiled") for file in (path, other)]
    trainer = AdapterTrainer(job=TINY, base_model=None, base_fingerprint="f" * 64, cache_dir=tmp_path / "adapters")
    service = DiscoveryService(tiny_llama(), tokenizer, served, trainer=trainer,
                               base_adapter=_fake_record(tmp_path, served[0].artifact, {}))
    assert [summary.get("training", {}).get("state") for summary in service.registries()] == [None, "queued"]


def test_a_replaying_recipe_trains_beside_the_catalogs_labelled_requests(tmp_path: Path, base_dir: Path) -> None:
    """The registry's own text and, drawn with it, every labelled training request of the bundled catalog."""
    from tooltrie.registry import CATALOG_PATH, load_registry
    from tooltrie.train.data import load_training_data
    from tooltrie.train.job import train_adapter

    tokenizer = smollm_tokenizer()
    artifact = compile_registry(_registry([{"name": n, "description": d} for n, d in catalog_tools(0, 6)]), tokenizer)
    record = train_adapter(artifact, tmp_path / "adapter", work=tmp_path / "work",
                           recipe=replace(TINY, replay="catalog"), base_model=str(base_dir), base_adapter=False)
    [replayed] = record.record["training"]["also"]
    catalog = load_training_data(replayed["directory"], compile_registry(load_registry(CATALOG_PATH), tokenizer))
    assert replayed["registry"]["sha256"] == catalog.meta.registry_sha256 == load_registry(CATALOG_PATH).sha256
    assert record.registry_sha256 == artifact.registry.sha256  # the adapter is still the registry's own
    assert catalog.meta.raw["queries"] == ["metatool-single", "metatool-multi", "catalog-situations"]
    assert replayed["train_examples"] == len(catalog.train) > 9_000
    assert {example.k for example in catalog.train} == {1, 2}  # single- and multi-tool requests


def test_a_recipe_replays_only_a_bundled_registry(tmp_path: Path) -> None:
    from tooltrie.train.job import train_adapter

    artifact = compile_registry(_registry([{"name": n, "description": d} for n, d in catalog_tools(0, 6)]),
                                smollm_tokenizer())
    with pytest.raises(ValueError, match=r"replay 'tools' is not a bundled registry.*choose one of bfcl, catalog"):
        train_adapter(artifact, tmp_path / "adapter", work=tmp_path / "work", recipe=replace(TINY, replay="tools"))
    assert not (tmp_path / "work").exists()  # refused before any work


def test_a_server_without_a_trainer_refuses_to_train(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    write_registry(path, "tools", catalog_tools(0, 6))
    service = DiscoveryService.from_paths([path], tiny_llama(), smollm_tokenizer(), cache_dir=tmp_path / "compiled")
    with running_server(service) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        reply = client.post("/v1/registries/tools/train")
        assert reply.status_code == 503 and "--train" in reply.json()["error"]["message"]
        assert "training" not in client.get("/v1/registries").json()["registries"][0]


def _registry(tools: list[dict[str, str]]) -> Any:
    from tooltrie.registry import make_registry

    return make_registry(tools, name="tools")


def _fake_record(tmp_path: Path, artifact: Any, ranker: dict[str, Any]) -> Any:
    """An adapter directory's record (no weights needed to rank) trained on ``artifact``."""
    from tooltrie.serve.adapter import AdapterRecord

    return AdapterRecord(path=tmp_path, base_model="tiny", base_fingerprint="f" * 64,
                         registry_name=artifact.registry.name, registry_sha256=artifact.registry.sha256,
                         tokenizer_fingerprint=artifact.tokenizer_fingerprint,
                         contract_sha256=artifact.contract.sha256, prompt_style="short",
                         record=json.loads(json.dumps({"ranker": ranker})))


def _ranked(body: dict[str, Any]) -> list[Any]:
    """An answer's tools and their scores, in order."""
    return [value for tool in body["tools"] for value in (tool["name"], tool["score"])]
