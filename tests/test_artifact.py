"""The compiled artifact: save/load round trip, header, placement, atomic writes, refusal of bad or mismatched
files, the compile cache, and the tokenizer fingerprint."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save, save_file

import tooltrie.compiler.cache as cache_module
from tooltrie.compiler import (
    CONSTANT_MEMORY_BUDGET,
    Artifact,
    Contract,
    TokenizerInfo,
    compile_cached,
    compile_registry,
)
from tooltrie.compiler.artifact import FORMAT, FORMAT_VERSION, arrays_sha256
from tooltrie.compiler.cache import cache_key
from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR
from tooltrie.errors import ArtifactError, ArtifactMismatchError, CompileError
from tooltrie.registry import Registry, make_registry


def _raw_header(path: Path) -> dict[str, object]:
    with safe_open(str(path), framework="np") as handle:
        return json.loads((handle.metadata() or {})["tooltrie"])


def _write_variant(path: Path, artifact: Artifact, *, header: object = None,
                   arrays: dict[str, np.ndarray] | None = None) -> Path:
    """A safetensors file with the artifact's arrays (or ``arrays``) and its header (or ``header``, as JSON).

    Replaced arrays get a matching checksum in the header, so the file is consistent and what is checked is
    the arrays' own validity; ``_flipped_bit`` covers the checksum itself.
    """
    if header is None:
        header = artifact.header()
        if arrays is not None:
            header["arrays_sha256"] = arrays_sha256(arrays)
    metadata = {"tooltrie": json.dumps(header)}
    path.write_bytes(save(dict(artifact.trie.arrays() if arrays is None else arrays), metadata=metadata))
    return path


# ---- round trip and header ----


def test_save_load_roundtrip(catalog_artifact: Artifact, saved_catalog_artifact: Path, catalog: Registry,
                             smollm: TokenizerInfo) -> None:
    loaded = Artifact.load(saved_catalog_artifact, tokenizer=smollm, registry=catalog, contract=Contract())
    original, again = catalog_artifact.trie.arrays(), loaded.trie.arrays()
    assert original.keys() == again.keys()
    for name, array in original.items():
        assert again[name].dtype == np.int32, name
        np.testing.assert_array_equal(again[name], array, err_msg=name)
    assert loaded.header() == catalog_artifact.header()
    assert loaded.sha256 == catalog_artifact.sha256
    assert loaded.registry.names == catalog.names
    assert loaded.registry.sha256 == catalog.sha256
    assert loaded.contract == Contract()
    assert loaded.split == catalog_artifact.split
    assert loaded.eos_id == smollm.eos_id
    names = catalog.names
    for answer in ([names[0]], names[:3], names[::-1][:5]):
        assert loaded.token_path(answer) == catalog_artifact.token_path(answer) == smollm.encode(", ".join(answer))


def test_a_registry_with_parameters_comes_back_whole(bfcl: Registry, smollm: TokenizerInfo, tmp_path: Path) -> None:
    """The header carries every tool's parameters (the native list), so the artifact's registry is the file's."""
    artifact = compile_registry(bfcl, smollm)
    artifact.save(tmp_path / "bfcl.safetensors")
    loaded = Artifact.load(tmp_path / "bfcl.safetensors")
    assert sum(bool(tool.parameters) for tool in bfcl.tools) > 1_800
    assert loaded.registry.tools == bfcl.tools
    assert [tool.parameters for tool in loaded.registry.tools] == [tool.parameters for tool in bfcl.tools]
    assert loaded.registry.sha256 == bfcl.sha256


def test_header_fields(catalog_artifact: Artifact, saved_catalog_artifact: Path, catalog: Registry,
                       smollm: TokenizerInfo) -> None:
    header = _raw_header(saved_catalog_artifact)  # read straight from the file, not through Artifact
    assert header["format"] == FORMAT == "tooltrie-artifact"
    assert header["format_version"] == FORMAT_VERSION == 1
    assert header["contract"] == {"version": 1, "separator": ", ", "stop": "eos"}
    assert header["contract_sha256"] == Contract().sha256
    assert re.fullmatch(r"[0-9a-f]{64}", str(header["contract_sha256"]))
    registry = header["registry"]
    assert isinstance(registry, dict)
    assert registry["sha256"] == catalog.sha256
    assert registry["name"] == "catalog"
    assert [tool["name"] for tool in registry["tools"]] == catalog.names
    tokenizer = header["tokenizer"]
    assert tokenizer == {"fingerprint": smollm.fingerprint, "source": "smollm2-135m", "eos_token": "<|im_end|>",
                         "eos_id": 2, "vocab_size": smollm.vocab_size}
    trie = header["trie"]
    assert isinstance(trie, dict)
    assert trie["device_bytes"] == sum(a.nbytes for a in catalog_artifact.trie.arrays().values())
    assert trie["tools"] == 47
    assert trie["fits_constant_memory"] is True
    assert trie["constant_memory_budget"] == CONSTANT_MEMORY_BUDGET
    assert header["split"] == {"left": catalog_artifact.split.left, "right": catalog_artifact.split.right}
    assert header["artifact_sha256"] == catalog_artifact.sha256
    # The file's header is header() (written from the registry's canonical JSON, not from header()'s dicts).
    assert header == catalog_artifact.header()
    assert registry["tools"] == [tool.content() for tool in catalog.tools]


def test_artifact_identity_depends_on_every_input(compiled: Callable[[str, str], Artifact], catalog: Registry,
                                                  smollm: TokenizerInfo) -> None:
    base = compiled("catalog", "smollm2-135m")
    other_tokenizer = compiled("catalog", "gpt2")
    other_registry = compile_registry(make_registry([t.content() for t in catalog.tools[:-1]], name="catalog"),
                                      smollm)
    other_contract = compile_registry(catalog, smollm, Contract(separator="\n"))
    same = compile_registry(catalog, smollm)
    assert same.sha256 == base.sha256
    assert len({a.sha256 for a in (base, other_tokenizer, other_registry, other_contract)}) == 4


@pytest.mark.parametrize(("registry_name", "tokenizer_name", "placement"), [
    ("catalog", "smollm2-135m", "constant"), ("catalog", "gpt2", "constant"),
    ("bfcl", "smollm2-135m", "global"), ("bfcl", "gpt2", "global"),
])
def test_placement(compiled: Callable[[str, str], Artifact], registry_name: str, tokenizer_name: str,
                   placement: str) -> None:
    artifact = compiled(registry_name, tokenizer_name)
    assert artifact.placement() == placement
    assert artifact.header()["trie"]["fits_constant_memory"] == (placement == "constant")
    size = artifact.trie.device_bytes
    assert artifact.placement(budget=size) == "constant"
    assert artifact.placement(budget=size - 1) == "global"


# ---- atomic save ----


def test_save_leaves_no_temp_files_and_creates_parents(catalog_artifact: Artifact, tmp_path: Path) -> None:
    target = tmp_path / "deep" / "er" / "a.safetensors"
    assert catalog_artifact.save(target) == target
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.safetensors"]
    Artifact.load(target)


def test_save_replaces_an_existing_file_whole(catalog_artifact: Artifact, tmp_path: Path) -> None:
    target = tmp_path / "a.safetensors"
    target.write_bytes(b"\xff" * 1_000_000)  # larger than the artifact: an in-place write would leave a tail
    before = target.stat().st_ino
    catalog_artifact.save(target)
    fresh = tmp_path / "fresh.safetensors"
    catalog_artifact.save(fresh)
    assert target.read_bytes() == fresh.read_bytes()
    assert target.stat().st_ino != before  # renamed over, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "fresh.safetensors"]


def test_failed_save_keeps_the_old_file_and_no_temp(catalog_artifact: Artifact, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "a.safetensors"
    catalog_artifact.save(target)
    old = target.read_bytes()

    def failing_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(ArtifactError, match=r"a\.safetensors: cannot write the artifact there: disk full"):
        catalog_artifact.save(target)
    assert target.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]


# ---- refusing bad files ----


def _truncated(path: Path, good: bytes, artifact: Artifact) -> Path:
    path.write_bytes(good[: len(good) // 2])
    return path


def _truncated_in_header(path: Path, good: bytes, artifact: Artifact) -> Path:
    path.write_bytes(good[:100])
    return path


def _truncated_last_byte(path: Path, good: bytes, artifact: Artifact) -> Path:
    path.write_bytes(good[:-1])
    return path


def _garbage(path: Path, good: bytes, artifact: Artifact) -> Path:
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    return path


def _text(path: Path, good: bytes, artifact: Artifact) -> Path:
    path.write_text("name: catalog\ntools: []\n" * 20, encoding="utf-8")
    return path


def _empty(path: Path, good: bytes, artifact: Artifact) -> Path:
    path.write_bytes(b"")
    return path


def _plain_safetensors(path: Path, good: bytes, artifact: Artifact) -> Path:
    save_file({"weight": np.zeros((2, 3), dtype=np.float32)}, str(path), metadata={"format": "pt"})
    return path


def _header_not_json(path: Path, good: bytes, artifact: Artifact) -> Path:
    path.write_bytes(save(dict(artifact.trie.arrays()), metadata={"tooltrie": "{not json"}))
    return path


def _tampered_registry_hash(path: Path, good: bytes, artifact: Artifact) -> Path:
    header = artifact.header()
    header["registry"]["sha256"] = "0" * 64
    return _write_variant(path, artifact, header=header)


def _tampered_tool(path: Path, good: bytes, artifact: Artifact) -> Path:
    header = artifact.header()
    header["registry"]["tools"][3]["name"] = "EvilTool"
    return _write_variant(path, artifact, header=header)


def _tampered_contract(path: Path, good: bytes, artifact: Artifact) -> Path:
    header = artifact.header()
    header["contract"]["separator"] = ";"
    return _write_variant(path, artifact, header=header)


def _other_format(path: Path, good: bytes, artifact: Artifact) -> Path:
    header = artifact.header()
    header["format_version"] = 99
    return _write_variant(path, artifact, header=header)


def _missing_header_field(path: Path, good: bytes, artifact: Artifact) -> Path:
    header = artifact.header()
    del header["split"]
    return _write_variant(path, artifact, header=header)


def _missing_array(path: Path, good: bytes, artifact: Artifact) -> Path:
    arrays = dict(artifact.trie.arrays())
    del arrays["edge_token"]
    return _write_variant(path, artifact, arrays=arrays)


def _broken_child(path: Path, good: bytes, artifact: Artifact) -> Path:
    arrays = {name: array.copy() for name, array in artifact.trie.arrays().items()}
    arrays["edge_child"][5] = 10**6
    return _write_variant(path, artifact, arrays=arrays)


def _flipped_bit(path: Path, good: bytes, artifact: Artifact) -> Path:
    """One bit of the array data flipped, the header left as it was."""
    (header_length,) = struct.unpack("<Q", good[:8])
    corrupt = bytearray(good)
    corrupt[8 + header_length + 4] ^= 0x01
    path.write_bytes(bytes(corrupt))
    return path


def _tool_count_mismatch(path: Path, good: bytes, artifact: Artifact) -> Path:
    header = artifact.header()
    header["registry"]["tools"] = header["registry"]["tools"][:-1]
    header["registry"]["sha256"] = make_registry(header["registry"]["tools"], name="catalog").sha256
    return _write_variant(path, artifact, header=header)


BAD_FILES = [
    pytest.param(_truncated, r"not a readable tooltrie artifact \(truncated or corrupt\?\)", id="truncated-half"),
    pytest.param(_truncated_in_header, r"not a readable tooltrie artifact \(truncated or corrupt\?\)",
                 id="truncated-in-header"),
    pytest.param(_truncated_last_byte, r"not a readable tooltrie artifact \(truncated or corrupt\?\)",
                 id="truncated-last-byte"),
    pytest.param(_garbage, r"not a readable tooltrie artifact", id="garbage"),
    pytest.param(_text, r"not a readable tooltrie artifact", id="text-file"),
    pytest.param(_empty, r"not a readable tooltrie artifact", id="empty"),
    pytest.param(_plain_safetensors, r"safetensors file without a tooltrie header", id="no-tooltrie-header"),
    pytest.param(_header_not_json, r"safetensors file without a tooltrie header", id="header-not-json"),
    pytest.param(_tampered_registry_hash, r"the registry in the header does not match its recorded sha256",
                 id="tampered-registry-hash"),
    pytest.param(_tampered_tool, r"the registry in the header does not match its recorded sha256",
                 id="tampered-tool-name"),
    pytest.param(_tampered_contract, r"the contract in the header does not match its recorded sha256",
                 id="tampered-contract"),
    pytest.param(_other_format, r"format 'tooltrie-artifact' version 99, expected 'tooltrie-artifact' version 1",
                 id="other-format-version"),
    pytest.param(_missing_header_field, r"malformed header: KeyError\('split'\)", id="header-without-split"),
    pytest.param(_missing_array, r"missing trie arrays: \['edge_token'\]", id="missing-array"),
    pytest.param(_broken_child, r"invalid trie: edge_child in range", id="edge-child-out-of-range"),
    pytest.param(_flipped_bit, r"the trie arrays do not match the checksum in the header", id="flipped-bit"),
    pytest.param(_tool_count_mismatch, r"trie has 47 tools, header lists 46", id="tool-count-mismatch"),
]


@pytest.mark.parametrize(("make_bad", "pattern"), BAD_FILES)
def test_bad_artifact_file(saved_catalog_artifact: Path, catalog_artifact: Artifact, tmp_path: Path,
                           make_bad: Callable[[Path, bytes, Artifact], Path], pattern: str) -> None:
    path = make_bad(tmp_path / "bad.safetensors", saved_catalog_artifact.read_bytes(), catalog_artifact)
    with pytest.raises(ArtifactError, match=pattern) as info:
        Artifact.load(path)
    assert not isinstance(info.value, ArtifactMismatchError)


@pytest.mark.parametrize("make_bad", [_truncated, _garbage, _empty, _plain_safetensors, _tampered_registry_hash],
                         ids=["truncated", "garbage", "empty", "no-tooltrie-header", "tampered-registry-hash"])
def test_bad_artifact_message_names_the_file(saved_catalog_artifact: Path, catalog_artifact: Artifact,
                                             tmp_path: Path, make_bad: Callable[[Path, bytes, Artifact], Path]) -> None:
    path = make_bad(tmp_path / "bad.safetensors", saved_catalog_artifact.read_bytes(), catalog_artifact)
    with pytest.raises(ArtifactError, match=f"^{re.escape(str(path))}: "):
        Artifact.load(path)


def test_missing_artifact(tmp_path: Path) -> None:
    path = tmp_path / "none.safetensors"
    with pytest.raises(ArtifactError, match=re.escape(f"{path}: artifact not found")):
        Artifact.load(path)


def test_truncation_at_every_cut_is_refused(saved_catalog_artifact: Path, tmp_path: Path) -> None:
    good = saved_catalog_artifact.read_bytes()
    (header_length,) = struct.unpack("<Q", good[:8])
    path = tmp_path / "cut.safetensors"
    cuts = sorted({0, 1, 7, 8, 9, 8 + header_length // 2, 8 + header_length, 8 + header_length + 1,
                   *range(8 + header_length + 4, len(good), 997), len(good) - 4, len(good) - 1})
    for cut in cuts:
        path.write_bytes(good[:cut])
        with pytest.raises(ArtifactError, match="not a readable tooltrie artifact"):
            Artifact.load(path)


@pytest.mark.parametrize("header", [[1, 2], "tooltrie"], ids=["list", "string"])
def test_header_that_is_not_an_object(catalog_artifact: Artifact, tmp_path: Path, header: object) -> None:
    path = _write_variant(tmp_path / "bad.safetensors", catalog_artifact, header=header)
    with pytest.raises(ArtifactError, match=re.escape(str(path))):
        Artifact.load(path)


def test_negative_path_edge_is_refused(catalog_artifact: Artifact, tmp_path: Path) -> None:
    arrays = {name: array.copy() for name, array in catalog_artifact.trie.arrays().items()}
    arrays["tool_path_edges"][3] = -5
    path = _write_variant(tmp_path / "bad.safetensors", catalog_artifact, arrays=arrays)
    with pytest.raises(ArtifactError, match="invalid trie"):
        Artifact.load(path)


# ---- mismatches ----


def test_loading_with_the_other_tokenizer(saved_catalog_artifact: Path, gpt2: TokenizerInfo,
                                          smollm: TokenizerInfo) -> None:
    with pytest.raises(ArtifactMismatchError,
                       match=rf"^{re.escape(str(saved_catalog_artifact))}: compiled for tokenizer smollm2-135m "
                       rf"\(fingerprint {smollm.fingerprint[:12]}\), used with gpt2 \(fingerprint "
                       rf"{gpt2.fingerprint[:12]}\); recompile with this tokenizer"):
        Artifact.load(saved_catalog_artifact, tokenizer=gpt2)


def test_loading_with_another_registry(saved_catalog_artifact: Path, catalog: Registry, bfcl: Registry,
                                       smollm: TokenizerInfo) -> None:
    with pytest.raises(ArtifactMismatchError, match=r"compiled for registry 'catalog' .*47 tools\), used with "
                       r"'bfcl' from .*bfcl\.jsonl .*1853 tools\); recompile the registry"):
        Artifact.load(saved_catalog_artifact, tokenizer=smollm, registry=bfcl)
    # One changed description is another registry too.
    edited = make_registry([{**catalog.tools[0].content(), "description": "changed"},
                            *(t.content() for t in catalog.tools[1:])], name="catalog")
    with pytest.raises(ArtifactMismatchError, match="compiled for registry 'catalog'"):
        Artifact.load(saved_catalog_artifact, registry=edited)


def test_loading_with_another_contract(saved_catalog_artifact: Path, smollm: TokenizerInfo,
                                       catalog: Registry) -> None:
    with pytest.raises(ArtifactMismatchError, match=r"compiled for contract \{'version': 1, 'separator': ', ', "
                       r"'stop': 'eos'\} .*used with \{'version': 1, 'separator': ' \| ', 'stop': 'eos'\}"):
        Artifact.load(saved_catalog_artifact, tokenizer=smollm, registry=catalog, contract=Contract(separator=" | "))


def test_mismatch_is_an_artifact_error(saved_catalog_artifact: Path, gpt2: TokenizerInfo) -> None:
    with pytest.raises(ArtifactError):
        Artifact.load(saved_catalog_artifact, tokenizer=gpt2)


def test_same_tokenizer_loaded_by_path_is_accepted(saved_catalog_artifact: Path) -> None:
    by_dir = TokenizerInfo.load(BUNDLED_TOKENIZERS_DIR / "smollm2-135m")
    by_file = TokenizerInfo.load(BUNDLED_TOKENIZERS_DIR / "smollm2-135m" / "tokenizer.json", eos_token="<|im_end|>")
    for tokenizer in (by_dir, by_file):
        Artifact.load(saved_catalog_artifact, tokenizer=tokenizer)


# ---- tokenizer fingerprint ----


def test_tokenizer_fingerprints(smollm: TokenizerInfo, gpt2: TokenizerInfo, tmp_path: Path) -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", smollm.fingerprint)
    assert smollm.fingerprint != gpt2.fingerprint
    assert TokenizerInfo.load("smollm2-135m").fingerprint == smollm.fingerprint  # stable across loads
    assert TokenizerInfo.load(BUNDLED_TOKENIZERS_DIR / "gpt2").fingerprint == gpt2.fingerprint  # and sources
    # What decides token ids is in it (the stop token, the normalizer); what does not (the decoder) is not.
    other_eos = TokenizerInfo.load("smollm2-135m", eos_token="<|endoftext|>")
    assert other_eos.fingerprint != smollm.fingerprint
    spec = json.loads((BUNDLED_TOKENIZERS_DIR / "gpt2" / "tokenizer.json").read_text(encoding="utf-8"))
    for change, same in ((("decoder", None), True), (("normalizer", {"type": "Lowercase"}), False)):
        folder = tmp_path / change[0]
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps({**spec, change[0]: change[1]}), encoding="utf-8")
        shutil.copy(BUNDLED_TOKENIZERS_DIR / "gpt2" / "tokenizer_config.json", folder)
        assert (TokenizerInfo.load(folder).fingerprint == gpt2.fingerprint) == same, change[0]


# ---- compile cache ----


def test_compile_cached_hits_without_recompiling(catalog: Registry, smollm: TokenizerInfo, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    first = compile_cached(catalog, smollm, cache_dir=tmp_path)
    files = list(tmp_path.iterdir())
    assert [p.name for p in files] == [f"catalog-{cache_key(catalog, smollm, Contract())}.safetensors"]
    mtime = files[0].stat().st_mtime_ns

    def no_compile(*args: object, **kwargs: object) -> Artifact:
        raise AssertionError("recompiled on a cache hit")

    monkeypatch.setattr(cache_module, "compile_registry", no_compile)
    second = compile_cached(catalog, smollm, cache_dir=tmp_path)
    assert second.sha256 == first.sha256
    for name, array in first.trie.arrays().items():
        np.testing.assert_array_equal(second.trie.arrays()[name], array)
    assert files[0].stat().st_mtime_ns == mtime


def test_compile_cached_uses_the_environment_cache_dir(catalog: Registry, smollm: TokenizerInfo, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLTRIE_CACHE_DIR", str(tmp_path / "env-cache"))
    compile_cached(catalog, smollm)
    assert len(list((tmp_path / "env-cache").glob("catalog-*.safetensors"))) == 1


def test_compile_cached_keys_on_every_input(catalog: Registry, smollm: TokenizerInfo, gpt2: TokenizerInfo,
                                            tmp_path: Path) -> None:
    compile_cached(catalog, smollm, cache_dir=tmp_path)
    compile_cached(catalog, gpt2, cache_dir=tmp_path)
    compile_cached(catalog, smollm, Contract(separator="\n"), cache_dir=tmp_path)
    small = make_registry([t.content() for t in catalog.tools[:5]], name="catalog")
    compile_cached(small, smollm, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 4


@pytest.mark.parametrize("corruption", [b"", b"garbage" * 100, None], ids=["empty", "garbage", "truncated"])
def test_compile_cached_recompiles_a_corrupt_entry(catalog: Registry, smollm: TokenizerInfo, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, corruption: bytes | None) -> None:
    compile_cached(catalog, smollm, cache_dir=tmp_path)
    (entry,) = tmp_path.iterdir()
    good = entry.read_bytes()
    entry.write_bytes(good[: len(good) // 3] if corruption is None else corruption)
    calls: list[int] = []
    real = cache_module.compile_registry

    def counting(*args: object, **kwargs: object) -> Artifact:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cache_module, "compile_registry", counting)
    artifact = compile_cached(catalog, smollm, cache_dir=tmp_path)
    assert calls == [1]
    assert entry.read_bytes() == good  # replaced by a good entry (compilation is deterministic)
    assert Artifact.load(entry, tokenizer=smollm, registry=catalog).sha256 == artifact.sha256
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]


@pytest.mark.parametrize("name", ["../escaped", "sub/../../escaped"], ids=["dotdot", "nested-dotdot"])
def test_compile_cached_stays_inside_the_cache_dir(smollm: TokenizerInfo, tmp_path: Path, name: str) -> None:
    cache_dir = tmp_path / "cache"
    registry = make_registry([{"name": "a"}, {"name": "b"}], name=name)
    compile_cached(registry, smollm, cache_dir=cache_dir)
    outside = [p for p in tmp_path.rglob("*.safetensors") if cache_dir not in p.parents]
    assert not outside, outside


def test_a_path_that_cannot_be_written_is_an_artifact_error(catalog_artifact: Artifact, tmp_path: Path) -> None:
    (tmp_path / "taken.safetensors").mkdir()
    (tmp_path / "file").write_text("x")
    for target in (tmp_path / "taken.safetensors", tmp_path / "file" / "a.safetensors"):
        with pytest.raises(ArtifactError, match="cannot write the artifact there"):
            catalog_artifact.save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "taken.safetensors"]


def test_a_header_past_the_format_limit_is_refused_before_writing(catalog_artifact: Artifact, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import tooltrie.compiler.artifact as artifact_module

    monkeypatch.setattr(artifact_module, "HEADER_LIMIT", 1_000)
    with pytest.raises(ArtifactError, match=r"header \(the registry's text\) takes [\d,]+ bytes; an artifact holds"):
        catalog_artifact.save(tmp_path / "a.safetensors")
    assert not list(tmp_path.iterdir())


def test_an_unwritable_cache_costs_a_compile_not_the_artifact(catalog: Registry, smollm: TokenizerInfo, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("x")
    artifact = compile_cached(catalog, smollm, cache_dir=tmp_path / "file" / "cache")
    assert artifact.registry.sha256 == catalog.sha256 and "was not cached" in caplog.text


def test_a_renamed_or_moved_registry_is_not_served_under_its_old_name(smollm: TokenizerInfo, tmp_path: Path) -> None:
    tools = [{"name": "get_a", "pointer": "https://a"}, {"name": "get_b", "pointer": "https://b"}]
    first = compile_cached(make_registry(tools, name="weather tools", source="a.yaml"), smollm, cache_dir=tmp_path)
    renamed = compile_cached(make_registry(tools, name="weather_tools", source="a.yaml"), smollm, cache_dir=tmp_path)
    moved = compile_cached(make_registry(tools, name="weather tools", source="b.yaml"), smollm, cache_dir=tmp_path)
    assert first.registry.sha256 == renamed.registry.sha256 == moved.registry.sha256
    assert [(a.registry.name, a.registry.source) for a in (first, renamed, moved)] == [
        ("weather tools", "a.yaml"), ("weather_tools", "a.yaml"), ("weather tools", "b.yaml")]


def test_a_separator_holding_a_special_token_is_refused(catalog: Registry, smollm: TokenizerInfo) -> None:
    with pytest.raises(CompileError, match=re.escape("separator '<|im_end|>' holds smollm2-135m's special token")):
        compile_registry(catalog, smollm, Contract(separator="<|im_end|>"))
