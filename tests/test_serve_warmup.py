"""The server's warm-up (``serve/warmup.py``): ``tooltrie serve`` listens before its registries' priors are made;
meanwhile ``/healthz`` answers 503 "warming" with Retry-After, a request that needs a warming registry's prior is
refused the same way (never left to embed 100,000 tools inside its timeout), a request ranked by the model alone is
answered, and once the prior is made everything is. Stopping the server ends the warm-up after the chunk in hand.
A made-up encoder held at a gate stands in for all-MiniLM-L6-v2; the model is the tiny random Llama."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from support.encoders import MadeUpEncoder
from support.serve import tiny_model
from support.serve_http import catalog, check_answer, running_server, smollm_tokenizer, wait_until

import tooltrie.embeddings as embeddings_module
from tooltrie.ranker import Ranker
from tooltrie.registry import CATALOG_PATH
from tooltrie.serve import service as service_module
from tooltrie.serve.errors import WarmingError
from tooltrie.serve.service import PROBE_TOOLS, DiscoveryService, ServedRegistry
from tooltrie.serve.warmup import WarmUp


class GatedEncoder(MadeUpEncoder):
    """Holds every encoder pass over the catalog's tools (a chunk of 8: not a query, not the health probe's 3 tools)
    until ``opened``; ``entered`` once one waits."""

    def __init__(self) -> None:
        super().__init__()
        self.opened, self.entered = threading.Event(), threading.Event()

    def encode(self, texts: list[str]) -> torch.Tensor:
        if len(texts) > len(PROBE_TOOLS):
            self.entered.set()
            if not self.opened.wait(timeout=60):
                raise RuntimeError("the test's encoder gate stayed closed for 60 s")
        return super().encode(texts)


def cold_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encoder: MadeUpEncoder) -> DiscoveryService:
    """The catalog served fused over the dense prior, its prior not made yet (as ``tooltrie serve`` starts)."""
    monkeypatch.setattr(embeddings_module, "CHUNK", 8)  # the catalog's 47 tools in 6 chunks
    monkeypatch.setattr(service_module, "ranker_for", lambda artifact, source, weights, prior: Ranker(
        artifact.registry, fused=weights, prior=prior, encoder=encoder))
    tokenizer = smollm_tokenizer()
    served = ServedRegistry.load(CATALOG_PATH, tokenizer, service_module.Prompt(), cache_dir=tmp_path)
    return DiscoveryService(tiny_model(), tokenizer, [served], cache_dir=tmp_path, retrieval=True, ranker="fused",
                            prior="dense", warm=False)


def test_a_warming_server_says_so_and_answers_what_it_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = GatedEncoder()
    service = cold_service(tmp_path, monkeypatch, encoder)
    query = {"query": "will it rain in Paris tomorrow", "k": 2}
    with running_server(service) as server:
        assert encoder.entered.wait(30)  # warming: the first chunk of tools is at the gate
        health = httpx.get(server.url + "/healthz", timeout=30)
        assert health.status_code == 503 and health.headers["Retry-After"].isdigit()
        assert health.json()["error"]["code"] == "warming" and "catalog" in health.json()["error"]["message"]
        refused = httpx.post(server.url + "/v1/discover", json=query, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "warming"
        assert "Retry-After" in refused.headers and "ranker=model" in refused.json()["error"]["message"]
        by_model = httpx.post(server.url + "/v1/discover", json={**query, "ranker": "model"}, timeout=30)
        assert by_model.status_code == 200, by_model.text
        check_answer(by_model.json(), catalog(), 2)

        encoder.opened.set()
        wait_until(lambda: httpx.get(server.url + "/healthz", timeout=30).status_code == 200, what="warm")
        fused = httpx.post(server.url + "/v1/discover", json=query, timeout=30)
        assert fused.status_code == 200, fused.text
        check_answer(fused.json(), catalog(), 2)
    tools = [text for text in encoder.encoded if text not in (query["query"], "")]  # "": the encoder warmed too
    assert len(tools) == len(PROBE_TOOLS) + len(catalog())  # every tool embedded once, by the warm-up


def test_stopping_ends_the_warm_up_after_the_chunk_in_hand(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = GatedEncoder()
    service = cold_service(tmp_path, monkeypatch, encoder)
    service.warmup.stream = io.StringIO()
    service.start()
    service.warm_up()
    assert encoder.entered.wait(30)
    service.stop()
    encoder.opened.set()
    service.warmup.join(30)
    assert service.warmup.warming("catalog")  # not made: the next start continues from the chunks kept
    tools = [text for text in encoder.encoded if text]  # "": the probe's encoder warmed too
    assert len(tools) == len(PROBE_TOOLS) + 8  # the probe's tools, the chunk in hand, and no other


def test_a_prior_that_fails_is_said_and_the_others_still_warm() -> None:
    class Failing:
        prior, progress = "dense", None

        def prior_scores(self, texts: list[str]) -> Any:
            raise RuntimeError("out of memory")

    made: list[str] = []

    class Fine(Failing):
        def prior_scores(self, texts: list[str]) -> Any:
            made.append("fine")

    out = io.StringIO()
    warmup = WarmUp({"broken": Failing(), "fine": Fine()}, stream=out)  # type: ignore[dict-item]
    with pytest.raises(WarmingError, match=r"2 registries: broken, fine"):
        warmup.check()
    with pytest.raises(WarmingError, match=r"making the prior of 2 registries$"):
        warmup.check(names=False)  # health is open to all under a policy: no registry named
    warmup.run()
    warmup.check()  # ready: the failed one's requests try again
    assert made == ["fine"]
    assert "broken: the prior failed (RuntimeError: out of memory)" in out.getvalue()
    assert "fine: prior ready (dense" in out.getvalue()
