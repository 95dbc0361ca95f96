"""Admission to vLLM's engine, without vLLM: whatever an engine step does with a request's ``vllm_xargs`` is checked
when vLLM validates the request (``validate_params``: ``parse_request_args``, ``validate_request``), and a request
that still cannot be added in the engine's process fails in its own row, never the step
(``ArtifactRows.admit``/``add``). Each test here is a way a client could once crash, stall or widen the engine."""

from __future__ import annotations

import base64
import os
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.integrations import vllm_rows
from tooltrie.integrations.vllm_rows import (
    FLAT_SHA256_KEY,
    LIMITS,
    ArtifactRows,
    ServedModel,
    encode_prior,
    parse_request_args,
    publish_artifact,
    record_served,
    request_args,
    served_model,
    validate_request,
)
from tooltrie.kernels.state import USED
from tooltrie.ranker import Ranker, follow_version
from tooltrie.registry import CATALOG_PATH, load_registry

N_TOOLS = 47  # the catalog's


def params(extra: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(extra_args=extra)


@pytest.fixture(scope="module")
def name(saved_catalog_artifact: Path) -> str:
    return publish_artifact(saved_catalog_artifact)


@pytest.fixture
def ranked(name: str) -> dict[str, Any]:
    """A catalog request ranked by the lexical prior, which follows its answer (flat form)."""
    made = Ranker(load_registry(CATALOG_PATH), prior="lexical").row("weather and news in Paris", "fused")
    return request_args(name, 2, prior=made.scores, model_weight=made.model_weight, follow=made.follow, flat=True)


@pytest.fixture
def served(artifact_root: Path, smollm: TokenizerInfo) -> Iterator[ServedModel]:
    """The served model recorded for this process, as vLLM's engine records it; removed afterwards."""
    model = ServedModel(smollm.fingerprint, smollm.vocab_size, smollm.eos_id)
    record_served(model)
    yield model
    for record in (artifact_root / vllm_rows.SERVED_DIR).iterdir():
        record.unlink()


# -- numbers whose float32 arithmetic would overflow in the step ---------------------------------------------------

HOSTILE_NUMBERS = [  # (what the request carries instead of its valid value, the key refused)
    ({"tooltrie_prior": [1e39] * N_TOOLS}, "'prior' must be 47 finite"),  # finite in float64, inf in float32
    ({"tooltrie_prior": [10**400] * N_TOOLS}, "'prior' must be 47 finite"),  # no float at all
    ({"tooltrie_prior": encode_prior([3e38] * N_TOOLS)}, "'prior' must be 47 finite"),  # sums overflow
    ({"tooltrie_model_weight": 1e300}, "'model_weight' must be a finite number"),
    ({"tooltrie_model_weight": -(10**400)}, "'model_weight' must be a finite number"),
    ({"tooltrie_follow": [1.0, 1e30, 0.5, 3.0]}, "'follow' must be four finite numbers"),
]


@pytest.mark.parametrize(("change", "refused"), HOSTILE_NUMBERS)
def test_numbers_a_step_would_overflow_are_refused(ranked: dict[str, Any], change: dict[str, Any],
                                                   refused: str) -> None:
    with pytest.raises(ValueError, match=refused):
        parse_request_args(params({**ranked, **change}))


def test_the_largest_accepted_numbers_fuse_to_finite_values(name: str) -> None:
    """At the bounds, the fused values a step writes stay finite (a logit beside the largest weight and prior)."""
    big = LIMITS.max_magnitude
    args = parse_request_args(params(request_args(name, 1, prior=[-big] * N_TOOLS, model_weight=big, flat=True)))
    rows = ArtifactRows("cpu")
    rows.add(0, args)
    logits = torch.full((1, vllm_rows.load_artifact(name).max_token_id + 1), -100.0)
    out = rows.apply(logits, [0], [[]])
    legal = out[0][out[0] > float("-inf")]
    assert len(legal) and torch.isfinite(legal).all()


# -- sizes checked before anything is decoded or stored ------------------------------------------------------------

def test_a_prior_of_the_wrong_length_is_refused_before_it_is_decoded(ranked: dict[str, Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []
    real = base64.b64decode
    monkeypatch.setattr(vllm_rows.base64, "b64decode", lambda text, **kw: decoded.append(len(text)) or real(text, **kw))
    huge = "f32:" + "A" * 40_000_000  # 30 MB of zeros, were it decoded
    with pytest.raises(ValueError, match="'prior' must be 47 finite"):
        parse_request_args(params({**ranked, "tooltrie_prior": huge}))
    assert decoded == []
    with pytest.raises(ValueError, match="'prior' must be 47 finite"):
        parse_request_args(params({**ranked, "tooltrie_prior": [0.0] * 10_000_000}))


ASK = encode_prior([0.5] * N_TOOLS)
BAD_ASKS = [  # (the request's asks, what is refused)
    ([ASK] * 9, "'asks' must be a list of 2 to 8 priors"),  # more asks than the splitter makes
    ([ASK], "'asks' must be a list of 2 to 8 priors"),  # one ask is the request itself
    (ASK, "'asks' must be a list of 2 to 8 priors"),
    ([ASK, "f32:" + "A" * 4_000_000], r"'asks'\[1\] must be 47 finite"),  # the size told from the text's length
    ([ASK, [0.0] * 46], r"'asks'\[1\] must be 47 finite"),
    ([ASK, [1e39] * N_TOOLS], r"'asks'\[1\] must be 47 finite"),  # overflows float32
]


@pytest.mark.parametrize(("asks", "refused"), BAD_ASKS)
def test_asks_are_checked_like_the_prior(ranked: dict[str, Any], asks: Any, refused: str) -> None:
    assert parse_request_args(params({**ranked, "tooltrie_asks": [ASK, ASK]})) is not None
    with pytest.raises(ValueError, match=refused):
        parse_request_args(params({**ranked, "tooltrie_asks": asks}))


def test_asks_without_a_prior_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="'asks' without 'prior'"):
        parse_request_args(params({**request_args(name, 2, flat=True), "tooltrie_asks": [ASK, ASK]}))


def test_a_long_query_and_a_large_k_are_refused(name: str, ranked: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"at most {LIMITS.max_query_chars} characters"):
        parse_request_args(params({**ranked, "tooltrie_query": "weather " * 1_000}))
    limits = vllm_rows.RowLimits(max_k=4)
    assert parse_request_args(params(request_args(name, 4, flat=True)), limits=limits) is not None
    with pytest.raises(ValueError, match="k=5 is more than 4"):
        parse_request_args(params(request_args(name, 5, flat=True)), limits=limits)
    with pytest.raises(ValueError, match="'tools' must be at most 47"):
        parse_request_args(params(request_args(name, 1, tools=range(48), flat=True)))


# -- one version of the follow-up on both sides --------------------------------------------------------------------

def test_a_follow_up_made_under_other_settings_is_refused(ranked: dict[str, Any]) -> None:
    assert ranked["tooltrie_follow_version"] == follow_version()
    assert parse_request_args(params(ranked)) is not None
    for version in ("0123456789abcdef", None):
        sent = {**ranked, "tooltrie_follow_version": version} if version else {
            key: value for key, value in ranked.items() if key != "tooltrie_follow_version"}
        with pytest.raises(ValueError, match=r"'follow_version' .* is not this processor's"):
            parse_request_args(params(sent))


def test_the_follow_ups_lexical_index_is_made_at_admission_not_in_the_step(ranked: dict[str, Any]) -> None:
    args = parse_request_args(params(ranked))
    indexed = vllm_rows.ARTIFACTS.indexed
    rows = ArtifactRows("cpu")
    rows.add(0, args)
    assert vllm_rows.ARTIFACTS.indexed == indexed  # the step found it made


def test_the_vllm_extra_brings_what_the_follow_up_imports() -> None:
    """The follow-up scores with BM25 (bm25s) inside vLLM's process: the extra a vLLM host installs brings it."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    wanted = next(line for line in project["optional-dependencies"]["model"] if line.startswith("bm25s"))
    assert wanted in project["optional-dependencies"]["vllm"]


# -- the artifact must fit the served model ------------------------------------------------------------------------

def test_an_artifact_of_another_tokenizer_is_refused_at_admission(served: ServedModel, compiled: Any,
                                                                   artifact_root: Path, name: str) -> None:
    assert served_model() == served
    other = compiled("catalog", "gpt2").save(artifact_root / "gpt2-catalog.trie.safetensors")
    with pytest.raises(ValueError, match="another tokenizer"):
        parse_request_args(params(request_args(other.name, 1, flat=True)))
    assert parse_request_args(params(request_args(name, 1, flat=True))) is not None


def test_an_artifact_beyond_the_served_vocabulary_is_refused(catalog_artifact: Artifact, name: str) -> None:
    narrow = ServedModel(None, catalog_artifact.max_token_id, 0)
    with pytest.raises(ValueError, match="beyond the served model's vocabulary"):
        vllm_rows.check_served(catalog_artifact, served=narrow)
    rows = ArtifactRows("cpu", narrow)  # unknown to admission, the engine's own check fails the row
    rows.add(0, parse_request_args(params(request_args(name, 1, flat=True))))
    assert 0 in rows.failed and 0 not in rows.args


# -- the step adds what was validated, or fails that row alone -----------------------------------------------------

def test_validation_pins_the_artifact_and_a_file_replaced_since_fails_only_its_row(
        name: str, artifact_root: Path, compiled: Any, catalog_artifact: Artifact) -> None:
    swapped = "swapped.trie.safetensors"
    shutil.copy(artifact_root / name, artifact_root / swapped)
    request = params(request_args(swapped, 2, flat=True))
    validate_request(request)  # vLLM's front end
    assert request.extra_args[FLAT_SHA256_KEY] == catalog_artifact.sha256
    other = compiled("catalog", "gpt2")  # another artifact under the same name before the engine adds it
    other.save(artifact_root / swapped)
    os.utime(artifact_root / swapped, ns=(1, 1))  # a new identity even within the file system's time resolution
    rows = ArtifactRows("cpu", ServedModel(None, catalog_artifact.max_token_id + 1, catalog_artifact.eos_id))
    assert rows.admit(0, request)  # ours, failed: never raised
    assert rows.admit(1, params(request_args(name, 1, flat=True)))
    assert 0 in rows.failed and 1 in rows.args
    logits = torch.zeros(2, catalog_artifact.max_token_id + 1)
    out = rows.apply(logits, [0, 1], [[], []])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [catalog_artifact.eos_id]  # only stop
    assert torch.isfinite(out[1]).sum() > 1  # the other row decodes
    rows.remove(0)
    assert not rows.failed


def test_a_request_the_engine_cannot_read_again_fails_its_row(name: str, artifact_root: Path) -> None:
    gone = "gone.trie.safetensors"
    shutil.copy(artifact_root / name, artifact_root / gone)
    request = params(request_args(gone, 1, flat=True))
    validate_request(request)
    (artifact_root / gone).unlink()
    vllm_rows.ARTIFACTS._loaded.clear()  # another process: nothing kept from admission
    rows = ArtifactRows("cpu", ServedModel(None, 49152, 0))
    assert rows.admit(3, request) and rows.failed == {3: 0}
    rows.move(3, 5, swap=False)
    assert rows.failed == {5: 0} and 3 not in rows


# -- state no wider than the live rows need ------------------------------------------------------------------------

def test_a_wide_request_widens_the_state_only_while_it_lives(name: str) -> None:
    rows = ArtifactRows("cpu")
    rows.add(0, parse_request_args(params(request_args(name, 1, flat=True))))
    state = rows.batches[name].state
    plain = (state.table.shape, state.counts.shape, state.ranker.shape)
    wide = request_args(name, 40, tools=range(45), prior=np.zeros(N_TOOLS), model_weight=1.0, flat=True)
    rows.add(1, parse_request_args(params(wide)))
    state = rows.batches[name].state
    assert state.table.shape[1] == USED + 40 and state.counts.shape[0] and state.ranker.shape[0]
    rows.remove(1)
    state = rows.batches[name].state
    assert (state.table.shape, state.counts.shape, state.ranker.shape) == plain
    logits = torch.zeros(2, vllm_rows.load_artifact(name).max_token_id + 1)
    assert torch.isfinite(rows.apply(logits, [0, -1], [[], []])[0]).any()  # row 0 goes on
