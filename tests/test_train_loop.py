"""The training loop on the tiny model: the loss falls, the run is seeded, the log and the adapter record say what
happened, and ``tooltrie train`` runs it from the command line."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.serve import SMALL_NAMES, small_artifact, tiny_model
from support.train import SMALL_LABELLED, write_training_data

from tooltrie.cli import main
from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.registry import make_registry
from tooltrie.serve.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, read_adapter
from tooltrie.serve.weights import model_fingerprint
from tooltrie.train import trainer
from tooltrie.train.batches import make_batch
from tooltrie.train.data import TrainingData, TrainingDataError, load_training_data
from tooltrie.train.settings import LoraSettings, TrainSettings
from tooltrie.train.trainer import TrainResult, train

# Shuffled epochs: every step of the tiny run sees the data evenly, so "the loss falls" is not left to the draws
# (balanced sampling, the default, draws with replacement; test_a_balanced_run_draws_and_records_its_sampling).
FAST = TrainSettings(steps=12, batch_size=4, learning_rate=2e-2, warmup_steps=2, eval_every=6, eval_examples=4,
                     lora=LoraSettings(rank=4, alpha=8, dropout=0.0), sampling="shuffled")


def _mail_artifact(smollm: TokenizerInfo) -> Artifact:
    return compile_registry(make_registry([{"name": "send_mail"}, {"name": "read_mail"}], name="mail"), smollm)


OTHER_LABELLED = (("Send the message", ("send_mail",)), ("Read my inbox", ("read_mail",)),
                  ("Mail it, then read the replies", ("send_mail", "read_mail")))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, smollm: TokenizerInfo) -> TrainingData:
    directory = write_training_data(tmp_path_factory.mktemp("data"), small_artifact(smollm), smollm)
    return load_training_data(directory, small_artifact(smollm))


def _train(data: TrainingData, smollm: TokenizerInfo, out: Path, settings: TrainSettings = FAST) -> TrainResult:
    return train(data, small_artifact(smollm), copy.deepcopy(tiny_model()), base_name="tiny", output=out,
                 settings=settings, progress=False)


def optimizer_rate(settings: TrainSettings, step: int) -> float:
    """The learning rate of 0-based ``step``: linear warm-up over ``warmup_steps``, then a cosine down to 0."""
    warmup, total = settings.warmup_steps, settings.steps
    if step < warmup:
        return settings.learning_rate * (step + 1) / warmup
    return settings.learning_rate * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_balanced_run_draws_and_records_its_sampling(data: TrainingData, smollm: TokenizerInfo,
                                                        tmp_path: Path) -> None:
    assert TrainSettings().sampling == "balanced"
    settings = TrainSettings(**{**FAST.__dict__, "steps": 3, "eval_every": 0, "sampling": "balanced"})
    result = _train(data, smollm, tmp_path / "adapter", settings)
    steps = [line for line in _log(tmp_path / "adapter.log.jsonl") if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2, 3]
    assert read_adapter(result.output).record["training"]["settings"]["sampling"] == "balanced"
    # Each step logs the rate it took: warm-up from the first step, then the cosine, never 0 on the last.
    taken = [optimizer_rate(settings, step) for step in range(3)]
    assert [line["lr"] for line in steps] == pytest.approx(taken) and taken[-1] > 0


@pytest.mark.parametrize("loss", ["plain", "trie", "both"])
def test_the_loss_falls_and_the_run_is_recorded(data: TrainingData, smollm: TokenizerInfo, tmp_path: Path,
                                                loss: str) -> None:
    settings = TrainSettings(**{**FAST.__dict__, "loss": loss})
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    result = _train(data, smollm, tmp_path / "adapter", settings)
    assert torch.get_num_threads() == threads and torch.equal(torch.random.get_rng_state(), rng)
    log = _log(tmp_path / "adapter.log.jsonl")
    steps = [line for line in log if "loss" in line]
    validations = [line["validation"] for line in log if "validation" in line]
    assert [line["step"] for line in steps] == list(range(1, 13))
    assert [v["step"] for v in validations] == [6, 12]
    first, last = validations[0], validations[-1]
    assert last["loss" if loss == "plain" else "trie_loss"] < first["loss" if loss == "plain" else "trie_loss"]
    assert sum(s["loss"] for s in steps[-3:]) < sum(s["loss"] for s in steps[:3])

    record = read_adapter(result.output)
    artifact = small_artifact(smollm)
    assert (record.base_model, record.base_fingerprint) == ("tiny", model_fingerprint(tiny_model()))
    assert (record.registry_name, record.registry_sha256) == ("small", artifact.registry.sha256)
    assert record.tokenizer_fingerprint == smollm.fingerprint and record.contract_sha256 == artifact.contract.sha256
    assert record.prompt_style == "short"
    training = record.record["training"]
    assert training["settings"]["loss"] == loss and training["examples_seen"] == 48
    assert record.record["validation"] == validations and result.validation == validations[-1]
    assert [point[0] for point in record.record["loss_curve"]] == list(range(1, 13))
    assert record.record["lora"]["rank"] == 4 and record.record["lora"]["stored_dtype"] == "float16"
    tensors = load_file(result.output / ADAPTER_WEIGHTS_FILE)
    assert len(tensors) == 2 * 7 * 2  # A and B, 7 linear layers, 2 blocks
    assert all(t.dtype == torch.float16 for t in tensors.values())
    assert any(name.endswith("lora_B.weight") and t.abs().sum() > 0 for name, t in tensors.items())


def test_the_same_seed_gives_the_same_adapter(data: TrainingData, smollm: TokenizerInfo, tmp_path: Path) -> None:
    settings = TrainSettings(**{**FAST.__dict__, "steps": 4, "eval_examples": 0})
    runs = [_train(data, smollm, tmp_path / name, settings) for name in ("a", "b")]
    other = _train(data, smollm, tmp_path / "c", TrainSettings(**{**settings.__dict__, "seed": 1}))
    a, b, c = (load_file(run.output / ADAPTER_WEIGHTS_FILE) for run in (*runs, other))
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not all(torch.equal(a[name], c[name]) for name in a)
    assert runs[0].record["loss_curve"] == runs[1].record["loss_curve"] != other.record["loss_curve"]
    assert runs[0].validation is None  # no validation sample asked for


def test_a_run_in_passes_trains_the_adapter_of_a_run_in_one(data: TrainingData, smollm: TokenizerInfo,
                                                             tmp_path: Path) -> None:
    """Every example its own pass (``max_attention_cells=1``): the steps' gradients add up to the whole batches'."""
    settings = TrainSettings(**{**FAST.__dict__, "steps": 3, "eval_examples": 0, "precision": "fp32"})
    whole, split = (_train(data, smollm, tmp_path / name, replace(settings, max_attention_cells=cells))
                    for name, cells in (("whole", settings.max_attention_cells), ("split", 1)))
    a, b = (load_file(run.output / ADAPTER_WEIGHTS_FILE) for run in (whole, split))
    for name in a:
        torch.testing.assert_close(a[name].float(), b[name].float(), rtol=1e-2, atol=1e-3)
    curves = [[loss for _, loss in run.record["loss_curve"]] for run in (whole, split)]
    assert curves[0] == pytest.approx(curves[1], abs=2e-4)


def test_hard_negatives_are_recorded_and_need_balanced_sampling(data: TrainingData, smollm: TokenizerInfo,
                                                                 tmp_path: Path) -> None:
    partners = {"get_user": "get_users", "get_users": "get_user", "search": "search_web"}
    settings = TrainSettings(**{**FAST.__dict__, "steps": 2, "eval_examples": 0, "sampling": "balanced"})
    result = train(data, small_artifact(smollm), copy.deepcopy(tiny_model()), base_name="tiny", output=tmp_path / "a",
                   settings=settings, progress=False, partners=partners)
    assert result.record["training"]["hard_negatives"] == 3
    assert _train(data, smollm, tmp_path / "b", replace(settings, steps=1)).record["training"]["hard_negatives"] is None
    with pytest.raises(ValueError, match="hard negatives are drawn by balanced sampling, not 'shuffled'"):
        train(data, small_artifact(smollm), copy.deepcopy(tiny_model()), base_name="tiny", output=tmp_path / "c",
              settings=FAST, progress=False, partners=partners)
    assert not (tmp_path / "c").exists()


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown loss 'focal'"):
        TrainSettings(loss="focal")
    with pytest.raises(ValueError, match="steps must be at least 1"):
        TrainSettings(steps=0)
    with pytest.raises(ValueError, match="unknown precision"):
        TrainSettings(precision="fp8")


def test_tooltrie_train_writes_an_adapter(data: TrainingData, smollm: TokenizerInfo, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "tiny"
    tiny_model().save_pretrained(base)
    registry = tmp_path / "small.yaml"
    registry.write_text("name: small\ntools:\n" + "".join(f"  - name: {name}\n" for name in SMALL_NAMES),
                        encoding="utf-8")
    mail = tmp_path / "mail.yaml"
    mail.write_text("name: mail\ntools:\n  - name: send_mail\n  - name: read_mail\n", encoding="utf-8")
    mail_data = write_training_data(tmp_path / "mail", _mail_artifact(smollm), smollm, OTHER_LABELLED,
                                    OTHER_LABELLED[:1])
    monkeypatch.setenv("TOOLTRIE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # the base given relative: the record names it resolved, peft as it was loaded
    code = main(["train", str(data.directory), "-o", str(tmp_path / "out"), "--base-model", "tiny",
                 "--tokenizer", "smollm2-135m", "--registry", str(registry), "--steps", "2", "--batch-size", "4",
                 "--rank", "2", "--eval-examples", "4", "--quiet", "--also", str(mail_data), str(mail)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "8 training examples (4 for validation) of registry 'small' and 3 of registry 'mail'" in err
    assert "tooltrie train: adapter" in err and "constrained exact" in err
    record = read_adapter(tmp_path / "out")
    assert record.base_model == str(base.resolve()) and record.record["lora"]["rank"] == 2
    config = json.loads((tmp_path / "out" / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
    assert config["base_model_name_or_path"] == record.base_model  # as the record names it, not peft's load path
    assert (tmp_path / "out.log.jsonl").is_file()

    code = main(["train", str(data.directory), "-o", str(tmp_path / "out2"), "--base-model", str(base),
                 "--tokenizer", "smollm2-135m", "--steps", "2", "--quiet"])  # the catalog: not what the data is for
    assert code == 2
    assert "is not the 'small' it was made for" in capsys.readouterr().err


def test_top_layers_adapts_the_last_blocks_only(data: TrainingData, smollm: TokenizerInfo, tmp_path: Path) -> None:
    lora = LoraSettings(rank=2, alpha=4, top_layers=1)
    settings = TrainSettings(**{**FAST.__dict__, "steps": 2, "eval_examples": 0, "lora": lora})
    result = _train(data, smollm, tmp_path / "top", settings)
    names = load_file(result.output / ADAPTER_WEIGHTS_FILE)
    assert len(names) == 7 * 2 and all(".layers.1." in name for name in names)
    assert result.record["lora"]["top_layers"] == 1
    from tooltrie.train.lora import TrainingSetupError

    with pytest.raises(TrainingSetupError, match="top_layers is 3 but the model has 2 blocks"):
        _train(data, smollm, tmp_path / "too-many",
               TrainSettings(**{**settings.__dict__, "lora": LoraSettings(top_layers=3)}))


def test_data_of_another_registry_is_drawn_from_and_recorded(data: TrainingData, smollm: TokenizerInfo,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other_artifact = _mail_artifact(smollm)
    other = load_training_data(write_training_data(tmp_path / "mail", other_artifact, smollm, OTHER_LABELLED,
                                                   OTHER_LABELLED[:1]), other_artifact)
    seen: list[str] = []

    def spy(examples: Any, **options: Any) -> Any:
        seen.extend(example.query for example in examples)
        return make_batch(examples, **options)

    monkeypatch.setattr(trainer, "make_batch", spy)
    settings = TrainSettings(**{**FAST.__dict__, "steps": 6, "eval_every": 0})
    result = train(data, small_artifact(smollm), copy.deepcopy(tiny_model()), base_name="tiny",
                   output=tmp_path / "adapter", settings=settings, progress=False, also=[other])
    trained = seen[: 6 * settings.batch_size]  # the steps' batches, then validation's
    assert {query for query, _ in OTHER_LABELLED} <= set(trained)  # shuffled epochs: every example is drawn
    assert {query for query, _ in SMALL_LABELLED} <= set(trained)
    record = read_adapter(result.output)
    assert record.registry_name == "small"  # the adapter is the primary registry's
    assert record.record["training"]["also"] == [{"directory": str(other.directory), "train_examples": 3,
                                                  "registry": {"name": "mail",
                                                               "sha256": other_artifact.registry.sha256}}]
    assert record.record["training"]["epochs"] == round(6 * 4 / 11, 3)


def test_data_made_otherwise_is_refused(data: TrainingData, smollm: TokenizerInfo, tmp_path: Path) -> None:
    directory = write_training_data(tmp_path / "catalog-style", small_artifact(smollm), smollm)
    meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    (directory / "meta.json").write_text(json.dumps({**meta, "prompt": {"style": "catalog"}}), encoding="utf-8")
    other = load_training_data(directory, small_artifact(smollm))
    with pytest.raises(TrainingDataError, match=r"catalog-style/meta.json: prompt_style is 'catalog', but 'short'"):
        train(data, small_artifact(smollm), copy.deepcopy(tiny_model()), base_name="tiny",
              output=tmp_path / "adapter", settings=FAST, progress=False, also=[other])
    assert not (tmp_path / "adapter").exists()
