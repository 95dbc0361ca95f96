"""LoRA adapters: merged without peft exactly as peft merges them, loaded by ``load_model`` (bundled, by path, or
left out), refused when broken or trained on another base, and reported when trained on other tools."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.serve import SMALL_NAMES, small_artifact, tiny_model

import tooltrie.serve.gguf as gguf_mod
import tooltrie.serve.model as model_mod
from tooltrie.cli import main
from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.registry import CATALOG_PATH, load_registry, make_registry
from tooltrie.serve.adapter import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    RECORD_FILE,
    AdapterError,
    is_adapter_dir,
    merge_adapter,
    read_adapter,
    write_adapter,
)
from tooltrie.serve.model import DEFAULT_MODEL_NAME, bundled_adapter, load_model, training_mismatch
from tooltrie.serve.weights import model_fingerprint
from tooltrie.testing import tiny_llama
from tooltrie.train.lora import attach_lora, lora_tensors
from tooltrie.train.settings import LoraSettings

IDS = torch.tensor([[1, 726, 79, 4093, 7916, 2, 81]])


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits  # type: ignore[no-any-return]


def _record(artifact: Artifact, base: str, fingerprint: str) -> dict[str, Any]:
    return {"base_model": {"name": base, "fingerprint": fingerprint},
            "registry": {"name": artifact.registry.name, "sha256": artifact.registry.sha256},
            "tokenizer": {"fingerprint": artifact.tokenizer_fingerprint},
            "contract_sha256": artifact.contract.sha256, "prompt_style": "short"}


def make_adapter(directory: Path, artifact: Artifact, *, base: str, fingerprint: str | None = None,
                 seed: int = 0) -> Any:
    """A rank-4 adapter of random (float16-exact) matrices on the tiny model; returns peft's own merge of it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = attach_lora(copy.deepcopy(tiny_model()), LoraSettings(rank=4, alpha=8, dropout=0.0))
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn_like(parameter).mul(0.05).half().float())
    tensors, config = lora_tensors(peft_model)
    write_adapter(directory, tensors, config,
                  _record(artifact, base, fingerprint or model_fingerprint(tiny_model())))
    return peft_model.merge_and_unload()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("base") / "tiny"
    tiny_model().save_pretrained(path)
    return path


@pytest.fixture
def adapter(tmp_path: Path, tiny_dir: Path, smollm: TokenizerInfo) -> tuple[Path, Any]:
    directory = tmp_path / "adapter"
    return directory, make_adapter(directory, small_artifact(smollm), base=str(tiny_dir))


# --- the merge -------------------------------------------------------------------------------------------------


def test_the_merge_is_peft_merge(adapter: tuple[Path, Any]) -> None:
    directory, peft_merged = adapter
    ours = copy.deepcopy(tiny_model())
    assert merge_adapter(ours, read_adapter(directory)) == 2 * 7  # 7 linear layers in each of 2 blocks
    torch.testing.assert_close(_logits(ours), _logits(peft_merged), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_logits(ours), _logits(tiny_model()), atol=1e-3)  # the adapter does something
    for name, weight in peft_merged.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], weight, rtol=1e-6, atol=1e-6)


# peft 0.21 asks transformers a deprecated question while wrapping a model; nothing for us to act on.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_loads_the_adapter_directory_too(adapter: tuple[Path, Any]) -> None:
    from peft import PeftModel

    directory, peft_merged = adapter
    loaded = PeftModel.from_pretrained(copy.deepcopy(tiny_model()), directory)
    torch.testing.assert_close(_logits(loaded), _logits(peft_merged), rtol=1e-5, atol=1e-5)


def test_an_adapter_is_small_and_its_files_are_readable(adapter: tuple[Path, Any]) -> None:
    directory, _ = adapter
    assert sorted(p.name for p in directory.iterdir()) == [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, RECORD_FILE]
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in directory.iterdir())
    assert sorted(p.name for p in directory.parent.iterdir()) == ["adapter"]  # no temporary directory left
    config = json.loads((directory / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")


# --- load_model --------------------------------------------------------------------------------------------------


def test_load_model_merges_an_adapter_directory(adapter: tuple[Path, Any], tiny_dir: Path,
                                                smollm: TokenizerInfo) -> None:
    directory, peft_merged = adapter
    model, info = load_model(directory)
    torch.testing.assert_close(_logits(model), _logits(peft_merged), rtol=1e-5, atol=1e-5)
    assert info.adapter is not None and info.adapter.path == directory and info.prompt_style == "short"
    assert info.adapter.registry_sha256 == small_artifact(smollm).registry.sha256
    assert info.fingerprint == model_fingerprint(model) != model_fingerprint(tiny_model())
    assert info.path == tiny_dir and not model.training

    base, base_info = load_model(directory, adapter=False)
    assert torch.equal(_logits(base), _logits(tiny_model()))
    assert base_info.adapter is None and base_info.prompt_style == "catalog"

    half, half_info = load_model(directory, dtype=torch.bfloat16)
    assert half_info.dtype == torch.bfloat16 and half_info.adapter is not None
    merged_weights = peft_merged.state_dict()  # merged in float32, then rounded to bfloat16
    for name, weight in half.state_dict().items():
        torch.testing.assert_close(weight.float(), merged_weights[name], rtol=2**-8, atol=1e-6)


def test_an_adapter_of_another_base_is_refused(tmp_path: Path, tiny_dir: Path, smollm: TokenizerInfo) -> None:
    make_adapter(tmp_path / "a", small_artifact(smollm), base=str(tiny_dir), fingerprint="0" * 64)
    with pytest.raises(AdapterError, match=r"trained on the base model .* fingerprint 000000000000, but"):
        load_model(tmp_path / "a")
    other = tmp_path / "other"
    tiny_llama(seed=1).save_pretrained(other)
    make_adapter(tmp_path / "b", small_artifact(smollm), base=str(other),
                 fingerprint=model_fingerprint(tiny_llama(seed=1)))
    assert load_model(tmp_path / "b")[1].adapter is not None
    with pytest.raises(AdapterError, match="do not fit its weight"):
        merge_adapter(_wider(), read_adapter(tmp_path / "b"))


def _wider() -> torch.nn.Module:
    """A tiny Llama with a wider MLP: the adapter's MLP matrices do not fit it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**tiny_model().config.to_dict(), "intermediate_size": 96})
    return LlamaForCausalLM(config)


def _break(directory: Path, how: str) -> str:
    from safetensors.torch import load_file, save_file

    if how == "no record":
        (directory / RECORD_FILE).unlink()
        return "tooltrie.json is missing"
    if how == "bad record":
        (directory / RECORD_FILE).write_text("[1, 2]", encoding="utf-8")
        return "expected a JSON object"
    if how == "other format":
        record = json.loads((directory / RECORD_FILE).read_text(encoding="utf-8"))
        record["format_version"] = 99
        (directory / RECORD_FILE).write_text(json.dumps(record), encoding="utf-8")
        return "version 1, found 'tooltrie-adapter' version 99"
    if how == "record lacks":
        record = json.loads((directory / RECORD_FILE).read_text(encoding="utf-8"))
        del record["prompt_style"]
        (directory / RECORD_FILE).write_text(json.dumps(record), encoding="utf-8")
        return "the record lacks 'prompt_style'"
    if how == "dora":
        config = json.loads((directory / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
        config["use_dora"] = True
        (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config), encoding="utf-8")
        return "use_dora is set"
    tensors = load_file(directory / ADAPTER_WEIGHTS_FILE)
    name = sorted(tensors)[0]
    if how == "lonely A":
        del tensors[name.replace("lora_A", "lora_B")]
        expected = "has lora_A but not its partner"
    elif how == "odd name":
        tensors["base_model.model.lm_head.weight"] = torch.zeros(2, 2)
        expected = "unexpected tensor 'base_model.model.lm_head.weight'"
    else:
        assert how == "no such layer"
        tensors[name.replace("layers.0", "layers.9")] = tensors.pop(name)
        tensors[name.replace("layers.0", "layers.9").replace("lora_A", "lora_B")] = tensors.pop(
            name.replace("lora_A", "lora_B"))
        expected = "the model has no layer model.layers.9"
    save_file(tensors, directory / ADAPTER_WEIGHTS_FILE)
    return expected


@pytest.mark.parametrize("how", ["no record", "bad record", "other format", "record lacks", "dora", "lonely A",
                                 "odd name", "no such layer"])
def test_a_broken_adapter_is_an_adapter_error(adapter: tuple[Path, Any], how: str) -> None:
    directory, _ = adapter
    expected = _break(directory, how)
    with pytest.raises(AdapterError, match=expected) as caught:
        merge_adapter(copy.deepcopy(tiny_model()), read_adapter(directory))
    assert str(directory) in str(caught.value)


# --- the bundled default -----------------------------------------------------------------------------------------


@pytest.fixture
def fake_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The default model replaced by tiny_llama() (a stand-in GGUF), and the bundled adapter's place by an empty
    directory; returns that place."""
    gguf = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(gguf_mod, "locate_default_gguf", lambda: gguf)
    monkeypatch.setattr(gguf_mod, "load_gguf", lambda path: tiny_llama())
    place = tmp_path / "default_adapter"
    place.mkdir()
    monkeypatch.setattr(model_mod, "DEFAULT_ADAPTER_DIR", place)
    return place


def test_without_a_bundled_adapter_the_default_is_the_base(fake_default: Path, tmp_path: Path) -> None:
    assert bundled_adapter() is None
    _, info = load_model(cache_dir=tmp_path / "cache")
    assert info.adapter is None and info.prompt_style == "catalog"
    assert info.fingerprint == model_fingerprint(tiny_llama())


def test_the_bundled_adapter_is_merged_into_the_default(fake_default: Path, tmp_path: Path,
                                                        smollm: TokenizerInfo) -> None:
    peft_merged = make_adapter(fake_default, small_artifact(smollm), base=DEFAULT_MODEL_NAME)
    assert bundled_adapter() == fake_default
    model, info = load_model(cache_dir=tmp_path / "cache")
    assert info.adapter is not None and info.prompt_style == "short" and info.name == DEFAULT_MODEL_NAME
    torch.testing.assert_close(_logits(model), _logits(peft_merged), rtol=1e-5, atol=1e-5)
    _, base_info = load_model(cache_dir=tmp_path / "cache", adapter=False)
    assert base_info.adapter is None and base_info.fingerprint == model_fingerprint(tiny_llama())
    _, by_path = load_model(fake_default, cache_dir=tmp_path / "cache")  # the same adapter, asked for by path
    assert by_path.fingerprint == info.fingerprint


def test_a_bundled_adapter_of_another_base_is_left_out(fake_default: Path, tmp_path: Path, smollm: TokenizerInfo,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    make_adapter(fake_default, small_artifact(smollm), base=DEFAULT_MODEL_NAME, fingerprint="f" * 64)
    with caplog.at_level(logging.WARNING, logger="tooltrie.serve.model"):
        _, info = load_model(cache_dir=tmp_path / "cache")
    assert info.adapter is None and info.prompt_style == "catalog"
    assert "answering with the base model alone" in caplog.text
    with pytest.raises(AdapterError, match="trained on the base model"):
        load_model(fake_default, cache_dir=tmp_path / "cache")


def test_the_shipped_adapter_if_any_is_small_and_for_the_catalog(smollm: TokenizerInfo) -> None:
    shipped = model_mod.DEFAULT_ADAPTER_DIR
    if not is_adapter_dir(shipped):
        pytest.skip(f"no adapter shipped yet in {shipped} (`make train`, then copy it there)")
    record = read_adapter(shipped)
    assert sum(p.stat().st_size for p in shipped.iterdir()) <= 10 * 2**20
    catalog = load_registry(CATALOG_PATH)
    assert record.base_model == DEFAULT_MODEL_NAME and record.prompt_style == "short"
    assert record.registry_sha256 == catalog.sha256 and record.tokenizer_fingerprint == smollm.fingerprint


# --- trained on other tools ----------------------------------------------------------------------------------------


def test_training_mismatch_names_what_differs(adapter: tuple[Path, Any], smollm: TokenizerInfo) -> None:
    directory, _ = adapter
    _, info = load_model(directory)
    assert training_mismatch(info.adapter, small_artifact(smollm)) is None
    other = compile_registry(make_registry([{"name": "get"}, {"name": "put"}], name="other"), smollm)
    message = training_mismatch(info.adapter, other)
    assert message is not None
    assert message.startswith("the model was not trained on these tools")
    assert "registry 'other'" in message and "the 'small' it was trained on" in message
    assert "`make train REGISTRY=" in message and "--base" in message
    _, base_info = load_model(directory, adapter=False)
    assert training_mismatch(base_info.adapter, other) is None  # a base model was trained on no registry


def test_ask_warns_about_other_tools_and_still_answers(adapter: tuple[Path, Any], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    directory, _ = adapter
    monkeypatch.setenv("TOOLTRIE_CACHE_DIR", str(tmp_path / "cache"))
    registry = tmp_path / "other.yaml"
    registry.write_text("name: other\ntools:\n  - name: get\n  - name: put\n  - name: post\n", encoding="utf-8")
    code = main(["ask", "Fetch it", "--k", "2", "--model", str(directory), "--registry", str(registry),
                 "--tokenizer", "smollm2-135m", "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "tooltrie ask: warning: the model was not trained on these tools" in err
    assert f"`make train REGISTRY={registry}`" in err
    names = [tool["name"] for tool in json.loads(out)["tools"]]
    assert len(names) == 2 == len(set(names)) and set(names) <= {"get", "put", "post"}

    small = tmp_path / "small.yaml"
    small.write_text("name: small\ntools:\n" + "".join(f"  - name: {n}\n" for n in SMALL_NAMES), encoding="utf-8")
    for extra in ([], ["--base"]):
        code = main(["ask", "Fetch it", "--k", "1", "--model", str(directory), "--registry", str(small),
                     "--tokenizer", "smollm2-135m", *extra])
        assert code == 0 and "warning" not in capsys.readouterr().err


# --- an adapter kept apart from the weights (one per registry, over one shared model) ---------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_with_its_own_adapter_answers_as_the_merged_model_does(
        adapter: tuple[Path, Any], smollm: TokenizerInfo, dtype: torch.dtype) -> None:
    """The low-rank updates added in each pass (stacked q/k/v and gate/up, norms folded in, rows reordered for the
    rotary turn) give the merged model's answers; the shared model is left as it was, and still answers alone."""
    from tooltrie.serve.engine import Engine, Request

    directory, peft_merged = adapter
    artifact = small_artifact(smollm)
    base, merged_model = (_with_norm_weights(copy.deepcopy(model).to(dtype)) for model in (tiny_model(), peft_merged))
    before = model_fingerprint(base)
    requests = [Request(query, k) for query in ("book a flight", "weather tomorrow in Paris", "send an email")
                for k in (1, 2, 3)]
    ours = Engine(base, smollm, artifact, adapter=read_adapter(directory)).run(requests)
    merged = Engine(merged_model, smollm, artifact).run(requests)
    alone = Engine(base, smollm, artifact).run(requests)
    assert model_fingerprint(base) == before
    assert [a.token_ids for a in ours] == [a.token_ids for a in merged]
    ours_scores, merged_scores, alone_scores = (np.array([tool.score for answer in answers for tool in answer.tools])
                                                for answers in (ours, merged, alone))
    rounding = np.abs(ours_scores - merged_scores).max()
    assert rounding < (1e-4 if dtype == torch.float32 else 0.15)  # bfloat16: W + BA rounded, or W and BA apart
    assert np.abs(ours_scores - alone_scores).max() > (1e-2 if dtype == torch.float32 else 0.05)  # the adapter tells


def _with_norm_weights(model: Any) -> Any:
    """``model`` with the same random RMSNorm weights whatever its other weights (initialised ones fold into
    anything)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1)
        for name, parameter in sorted(model.named_parameters()):
            if "norm" in name:
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
    return model
