"""Weights read a tensor at a time (``serve/weights_file.py``) against ``from_pretrained``: the same weights bit for
bit (with an adapter merged in float32 before the cast), the float32 fingerprint without a float32 model, sharded
files, and clear errors for damaged ones. And the engine-only model (``release_copied_weights``): the weights the
decoder copied are let go and the answers do not change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from support.serve import small_artifact, tiny_model
from test_adapter import make_adapter

from tooltrie.compiler import TokenizerInfo
from tooltrie.errors import ModelError
from tooltrie.serve.adapter import merge_adapter, read_adapter
from tooltrie.serve.decoder import release_copied_weights
from tooltrie.serve.engine import Engine, Request
from tooltrie.serve.model import _load_directory, load_model
from tooltrie.serve.weights import model_fingerprint
from tooltrie.serve.weights_file import read_streamed, safetensors_files

IDS = torch.tensor([[1, 726, 79, 4093, 7916, 2, 81]])


def _reference(directory: Path, dtype: torch.dtype, adapter: Path | None = None) -> tuple[Any, str]:
    """What loading was before: float32 from ``from_pretrained``, its fingerprint, the merge, then the cast of
    every parameter (the buffers as ``from_pretrained`` in ``dtype`` keeps them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    fingerprint = model_fingerprint(model)
    if adapter is not None:
        merge_adapter(model, read_adapter(adapter))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.to(dtype)
    return model.eval(), fingerprint


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("streamed") / "tiny"
    tiny_model().save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adapted", [False, True], ids=["base", "adapter"])
def test_streamed_weights_are_from_pretrained_s_bit_for_bit(base_dir: Path, tmp_path: Path, smollm: TokenizerInfo,
                                                            dtype: torch.dtype, adapted: bool) -> None:
    adapter = None
    if adapted:
        adapter = tmp_path / "adapter"
        make_adapter(adapter, small_artifact(smollm), base=str(base_dir))
    files = safetensors_files(base_dir)
    assert files == [base_dir / "model.safetensors"]
    ours, fingerprint = read_streamed(base_dir, files, dtype=dtype,
                                      adapter=None if adapter is None else read_adapter(adapter))
    theirs, their_fingerprint = _reference(base_dir, dtype, adapter)
    assert fingerprint == their_fingerprint == model_fingerprint(tiny_model())  # the base's, in float32
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert sorted(mine) == sorted(reference)
    for name, tensor in reference.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # still tied
    assert model_fingerprint(ours) == model_fingerprint(theirs)
    with torch.no_grad():
        assert torch.equal(ours(IDS).logits, theirs(IDS).logits)


def test_a_sharded_directory_reads_every_shard(base_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    sharded = tmp_path / "sharded"
    shutil.copytree(base_dir, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for shard, part in enumerate((names[::2], names[1::2])):
        file = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, sharded / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}), encoding="utf-8")
    files = safetensors_files(sharded)
    assert files is not None and len(files) == 2
    model, _ = read_streamed(sharded, files, dtype=torch.float32)
    for name, tensor in tiny_model().state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("damage", ["truncated", "huge header", "wrong shape"])
def test_a_damaged_weights_file_is_a_model_error_naming_it(base_dir: Path, tmp_path: Path, damage: str) -> None:
    from safetensors.torch import load_file, save_file

    target = tmp_path / "model"
    shutil.copytree(base_dir, target)
    weights = target / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-1000])
        expected = "the file ends inside its data"
    elif damage == "huge header":
        weights.write_bytes((10**12).to_bytes(8, "little") + weights.read_bytes()[8:])
        expected = "a header of 1,000,000,000,000 bytes"
    else:
        tensors = load_file(weights)
        tensors["model.norm.weight"] = torch.ones(3)
        save_file(tensors, weights, metadata={"format": "pt"})
        expected = r"model.norm.weight has shape \(3,\), the model's is \(64,\)"
    with pytest.raises(ModelError, match=expected) as caught:
        load_model(target)
    assert str(target) in str(caught.value)


def test_a_quantized_or_unsafe_directory_is_left_to_from_pretrained(base_dir: Path, tmp_path: Path) -> None:
    quantized = tmp_path / "quantized"
    shutil.copytree(base_dir, quantized)
    config = json.loads((quantized / "config.json").read_text(encoding="utf-8"))
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "x"}}),
                                           encoding="utf-8")
    assert safetensors_files(quantized) is None
    pickled = tmp_path / "pickled"
    shutil.copytree(base_dir, pickled)
    (pickled / "model.safetensors").unlink()
    assert safetensors_files(pickled) is None


# --- the engine-only model ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_releasing_the_copied_weights_keeps_every_answer(base_dir: Path, tmp_path: Path, smollm: TokenizerInfo,
                                                         dtype: torch.dtype) -> None:
    """Answers before and after, alone and with a registry's own adapter; in bfloat16 every projection is let go
    (the decoder holds them prepacked), in float32 q/k/v and gate/up (stacked copies; o and down are shared)."""
    adapter_dir = tmp_path / "adapter"
    make_adapter(adapter_dir, small_artifact(smollm), base=str(base_dir))
    adapter = read_adapter(adapter_dir)
    artifact = small_artifact(smollm)
    model, _ = load_model(base_dir, dtype=dtype)
    requests = [("book a flight", 2), ("weather tomorrow in Paris", 1), ("send an email", 3)]

    def answers(engine: Engine) -> list[Any]:
        return [(a.token_ids, [t.score for t in a.tools]) for a in engine.run([Request(q, k) for q, k in requests])]

    before = answers(Engine(model, smollm, artifact)), answers(Engine(model, smollm, artifact, adapter=adapter))
    projections = {name: p.numel() * p.element_size() for name, p in model.named_parameters() if "proj" in name}
    freed = release_copied_weights(model)
    after = answers(Engine(model, smollm, artifact)), answers(Engine(model, smollm, artifact, adapter=adapter))
    assert after == before
    prepacked = dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    kept = set() if prepacked else {"o_proj", "down_proj"}
    expected = sum(size for name, size in projections.items() if name.split(".")[-2] not in kept)
    assert freed == expected > 0
    assert release_copied_weights(model) == 0  # nothing left to let go
    with pytest.raises(ModelError, match="handed to its engines"):
        model(IDS)


def test_both_loads_leave_the_same_model(base_dir: Path, tmp_path: Path, smollm: TokenizerInfo) -> None:
    """A directory ``from_pretrained`` loads (pickled weights) gives what the streamed read gives, adapter merged,
    in bfloat16, buffers included: the rotary frequencies stay float32 (``cast_parameters``) either way."""
    from safetensors.torch import load_file

    adapter = tmp_path / "adapter"
    make_adapter(adapter, small_artifact(smollm), base=str(base_dir))
    pickled = tmp_path / "pickled"
    shutil.copytree(base_dir, pickled)
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    assert safetensors_files(pickled) is None
    streamed, _ = _load_directory(base_dir, dtype=torch.bfloat16, adapter=read_adapter(adapter))
    pretrained, _ = _load_directory(pickled, dtype=torch.bfloat16, adapter=read_adapter(adapter))
    for ours, theirs in ((streamed.state_dict(), pretrained.state_dict()),
                         (dict(streamed.named_buffers()), dict(pretrained.named_buffers()))):
        assert sorted(ours) == sorted(theirs)
        for name, tensor in theirs.items():
            assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    assert streamed.model.rotary_emb.inv_freq.dtype == torch.float32
