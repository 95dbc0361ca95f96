"""The shipped default: base SmolLM2 + the bundled LoRA adapter, trained on the bundled catalog.

It is small, it records what it was trained against (and that is the bundled catalog as compiled here), and it
reloads to the same answers: a fixed sample of held-out MetaTool queries (``support/adapter_answers.json``, written
by ``support/write_adapter_answers.py`` when the adapter was shipped) must be answered exactly so, in the dtype it
is served in.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from tooltrie.compiler import TokenizerInfo, compile_registry
from tooltrie.ranker import MODEL_ONLY, UNTRAINED, Weights
from tooltrie.ranker_policy import auto_ranker, fused_weights
from tooltrie.registry import CATALOG_PATH, load_registry, make_registry
from tooltrie.serve.engine import Engine, Request
from tooltrie.serve.model import (
    DEFAULT_ADAPTER_DIR,
    bundled_adapter,
    load_model,
    serving_dtype,
    training_mismatch,
)
from tooltrie.serve.prompt import Prompt
from tooltrie.train.command import add_train_command, settings_from_args

EXPECTED = Path(__file__).parent / "support" / "adapter_answers.json"
MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"

pytestmark = pytest.mark.skipif(bundled_adapter() is None, reason="no adapter is shipped in serve/default_adapter")


@pytest.fixture(scope="module")
def default() -> tuple[Any, Any]:
    return load_model(dtype=serving_dtype())


def test_the_adapter_is_small() -> None:
    size = sum(path.stat().st_size for path in DEFAULT_ADAPTER_DIR.iterdir() if path.is_file())
    assert size <= 10 * 2**20, f"{size:,} bytes"


def test_the_default_was_trained_on_the_bundled_catalog(default: tuple[Any, Any]) -> None:
    _, info = default
    assert info.adapter is not None and info.prompt_style == "short"
    artifact = compile_registry(load_registry(CATALOG_PATH), TokenizerInfo.load(info.tokenizer))
    assert training_mismatch(info.adapter, artifact) is None


def test_the_fused_weights_are_the_adapters_own_on_its_registry_and_retrieval_leads_elsewhere(
        default: tuple[Any, Any]) -> None:
    _, info = default
    tokenizer = TokenizerInfo.load(info.tokenizer)
    own = info.adapter.record.get("ranker", {}).get("fused")
    expected = MODEL_ONLY if own is None else Weights(**own)
    assert fused_weights(info.adapter, compile_registry(load_registry(CATALOG_PATH), tokenizer)) == expected
    other = compile_registry(make_registry([{"name": "get_weather"}, {"name": "send_mail"}], name="elsewhere"),
                             tokenizer)
    assert fused_weights(info.adapter, other) == UNTRAINED
    # --ranker auto: where it was trained, what its record's measurement chose (fused, chosen on plain and
    # need-describing validation requests together); elsewhere fused; the model alone without the retrieval model
    measured = info.adapter.record["ranker"]
    assert measured["auto"] == "fused" and "catalog-needs" in measured["chosen_on"]
    by_kind = measured["by_kind"]  # and what was measured per kind of request, requests of several asks included
    assert {"plain", "need", "compound", "composed"} <= set(by_kind) and "compound_study" in by_kind["chosen_on"]
    catalog = compile_registry(load_registry(CATALOG_PATH), tokenizer)
    assert [auto_ranker(info.adapter, a, retrieval=r) for a in (catalog, other) for r in (True, False)] == [
        "fused", "model", "fused", "model"]
    # the record's choice is what decides: the same adapter recording the model alone answers alone on the catalog
    alone = replace(info.adapter, record={**info.adapter.record, "ranker": {**measured, "auto": "model"}})
    assert auto_ranker(alone, catalog, retrieval=True) == "model"
    assert auto_ranker(alone, other, retrieval=True) == "fused"


def test_the_default_reproduces_its_held_out_answers(default: tuple[Any, Any]) -> None:
    model, info = default
    expected = json.loads(EXPECTED.read_text(encoding="utf-8"))
    tokenizer = TokenizerInfo.load(info.tokenizer)
    engine = Engine(model, tokenizer, compile_registry(load_registry(CATALOG_PATH), tokenizer),
                    prompt=Prompt.style(info.prompt_style))
    answers = engine.run([Request(case["query"], case["k"]) for case in expected])
    assert [[t.name for t in answer.tools] for answer in answers] == [case["tools"] for case in expected]


def test_make_train_remakes_the_default_with_the_settings_it_was_made_with() -> None:
    """``make train ADAPTER=serve/default_adapter`` passes the Makefile's TRAIN_OPTIONS: the shipped adapter's record
    must name the same settings, or docs/training.md's recipe is not the one that made it."""
    line = next(line for line in MAKEFILE.read_text(encoding="utf-8").splitlines()
                if line.startswith("TRAIN_OPTIONS ?="))
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers())
    args = parser.parse_args(["train", "DATA", "-o", "OUT", *shlex.split(line.partition("?=")[2])])
    settings = json.loads(json.dumps(asdict(settings_from_args(args))))  # tuples as the record's lists
    record = json.loads((DEFAULT_ADAPTER_DIR / "tooltrie.json").read_text(encoding="utf-8"))
    assert {k: v for k, v in record["lora"].items() if k not in ("parameters", "stored_dtype")} == settings.pop("lora")
    assert record["training"]["settings"] == settings
