"""A request's tooltrie arguments in vLLM's ``SamplingParams.extra_args``, without vLLM: the nested form
(``{"tooltrie": {"artifact", "k", "tools"}}``) and the flat one (``tooltrie_artifact``, ``tooltrie_k``,
``tooltrie_tools``, what vLLM's OpenAI server can carry in ``vllm_xargs``) mean the same request, a prior and how it
follows the answer included (``tooltrie_prior``, ``tooltrie_model_weight``, ``tooltrie_query``, ``tooltrie_follow``);
malformed ones are refused with an error naming the key. An artifact is a name in the processor's root
(``$TOOLTRIE_ARTIFACT_ROOT``, a temporary directory in the tests: ``conftest.artifact_root``): a name that is not a
file there, or leads out of it, is the same "unknown artifact name", which shows nothing of the file system."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tooltrie.compiler import Artifact
from tooltrie.compiler import artifact as artifact_module
from tooltrie.errors import ArtifactError
from tooltrie.integrations import vllm_rows
from tooltrie.integrations.vllm_rows import (
    RequestArgs,
    encode_prior,
    parse_request_args,
    publish_artifact,
    request_args,
)
from tooltrie.ranker import Prior, Ranker
from tooltrie.registry import CATALOG_PATH, load_registry


def parse(extra: dict[str, Any] | None, **fields: Any) -> RequestArgs | None:
    """The parsed arguments, less the artifact's sha256 they pin (checked: the loaded artifact's)."""
    args = parse_request_args(SimpleNamespace(extra_args=extra, **fields))
    if args is None:
        return None
    assert args.sha256 == vllm_rows.load_artifact(args.artifact).sha256
    return replace(args, sha256=None)


@pytest.fixture(scope="module")
def name(saved_catalog_artifact: Path) -> str:
    """The catalog artifact's name in the root (copied there once)."""
    return publish_artifact(saved_catalog_artifact)


@pytest.mark.parametrize("k", [1, 3, 47])
def test_nested_and_flat_forms_are_the_same_request(name: str, k: int) -> None:
    nested, flat = request_args(name, k), request_args(name, k, flat=True)
    assert flat == {"tooltrie_artifact": name, "tooltrie_k": k}
    assert parse(nested) == parse(flat) == RequestArgs(name, k)
    assert parse({**flat, "other_plugin": [1, 2]}) == RequestArgs(name, k)


def test_a_file_is_named_by_its_copy_in_the_root(saved_catalog_artifact: Path, artifact_root: Path) -> None:
    named = request_args(saved_catalog_artifact, 2, flat=True)["tooltrie_artifact"]
    assert os.sep not in named and (artifact_root / named).read_bytes() == saved_catalog_artifact.read_bytes()
    assert request_args(str(saved_catalog_artifact), 2)["tooltrie"]["artifact"] == named  # written once, same name
    assert publish_artifact(artifact_root / named) == named  # a file of the root is named as it is


def test_a_subset_travels_as_tool_ids(name: str) -> None:
    flat = request_args(name, 2, tools={9, 4, 30}, flat=True)
    assert flat == {"tooltrie_artifact": name, "tooltrie_k": 2, "tooltrie_tools": [4, 9, 30]}
    assert parse(flat) == parse(request_args(name, 2, tools=[30, 4, 9])) == RequestArgs(name, 2, tools=(4, 9, 30))
    assert parse({"tooltrie_artifact": name, "tooltrie_k": 3, "tooltrie_tools": [4, 9, 30]}) is not None


def test_requests_without_arguments_are_not_ours() -> None:
    assert parse(None) is None
    assert parse({}) is None
    assert parse({"tooltrip_k": 2, "other": {"artifact": "x"}}) is None


def test_a_thinking_budget_is_noted(name: str) -> None:
    args = parse(request_args(name, 2, flat=True), thinking_token_budget=64)
    assert args is not None and args.thinking_budget


BAD_EXTRA_ARGS = [  # (extra_args, the error's words); "{name}" stands for a real artifact's name
    ({"tooltrie": "{name}"}, "extra_args['tooltrie'] must be"),
    ({"tooltrie": {"k": 1}}, "extra_args['tooltrie'] must be"),
    ({"tooltrie": {"artifact": "{name}", "k": "2"}}, "extra_args['tooltrie'] must be"),
    ({"tooltrie": {"artifact": "{name}", "k": 2, "tool": [1]}}, "extra_args['tooltrie'] must be"),
    ({"tooltrie": {"artifact": "{name}", "k": 0}}, "k=0 is outside 1..47"),
    ({"tooltrie_artifact": "{name}"}, "extra_args must be"),
    ({"tooltrie_k": 2}, "extra_args must be"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": "2"}, "extra_args must be"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2.0}, "extra_args must be"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": True}, "extra_args must be"),
    ({"tooltrie_artifact": ["{name}"], "tooltrie_k": 2}, "extra_args must be"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 48}, "k=48 is outside 1..47"),
    ({"tooltrie_artifact": "nonexistent.safetensors", "tooltrie_k": 1}, "unknown artifact name"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_K": 3}, "unknown key 'tooltrie_K'"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie": {"artifact": "{name}", "k": 2}}, "not both"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_tools": 3}, "extra_args must be"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_tools": [1, "2"]}, "'tools' must be at most 47"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_tools": [1, 2.0]}, "'tools' must be at most 47"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_tools": [1, 47]}, "tools: tool indices [47]"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_tools": [-1, 3]}, "tools: tool indices [-1]"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 3, "tooltrie_tools": [1, 2]}, "k=3 but only 2 tools are allowed"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_tools": []}, "k=1 but only 0 tools are allowed"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_tools": [5, 5]}, "names a tool more than once"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_prior": [0.5] * 46}, "'prior' must be 47 finite"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_prior": [0.5] * 46 + [float("nan")]},
     "'prior' must be 47 finite"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_prior": [0.5] * 46 + ["1"]}, "'prior' must be 47"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_prior": 0.5}, "'prior' must be 47 finite"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_prior": encode_prior([0.5] * 46)},
     "'prior' must be 47 finite"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_prior": encode_prior([0.5] * 46 + [float("inf")])},
     "'prior' must be 47 finite"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_prior": "f32:not base64!"}, "'prior' must be 47"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_prior": "f32:AAAA"}, "'prior' must be 47 finite"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_model_weight": 0.5}, "'model_weight' without"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 1, "tooltrie_prior": [0.0] * 47,
      "tooltrie_model_weight": float("inf")}, "'model_weight' must be a finite number"),
    ({"tooltrie": {"artifact": "{name}", "k": 1, "prior": [0.0] * 47, "model_weight": "1"}},
     "'model_weight' must be a finite number"),
    # how the prior follows the answer: the request's text and four finite numbers, with a prior
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_query": "weather",
      "tooltrie_follow": [1.0, 1.0, 0.25, 3.0]}, "extra_args: 'follow' without 'prior'"),
    ({"tooltrie": {"artifact": "{name}", "k": 2, "query": "weather", "follow": [1.0, 1.0, 0.25, 3.0]}},
     "extra_args['tooltrie']: 'follow' without 'prior'"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_prior": [0.0] * 47, "tooltrie_follow": [1, 1, 0.25, 3]},
     "extra_args: 'follow' without 'query'"),
    ({"tooltrie": {"artifact": "{name}", "k": 2, "prior": [0.0] * 47, "follow": [1.0, 1.0, 0.25, 3.0]}},
     "extra_args['tooltrie']: 'follow' without 'query'"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_prior": [0.0] * 47, "tooltrie_query": "weather"},
     "extra_args: 'query' without 'follow'"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_query": "weather"}, "'query' without 'follow'"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_prior": [0.0] * 47, "tooltrie_query": ["weather"],
      "tooltrie_follow": [1.0, 1.0, 0.25, 3.0]}, "extra_args: 'query' must be the request's text (a string)"),
    ({"tooltrie": {"artifact": "{name}", "k": 2, "prior": [0.0] * 47, "query": 3, "follow": [1.0, 1.0, 0.25, 3.0]}},
     "extra_args['tooltrie']: 'query' must be the request's text"),
    *[({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_prior": [0.0] * 47, "tooltrie_query": "weather",
        "tooltrie_follow": follow}, "extra_args: 'follow' must be four finite numbers")
      for follow in ([1.0, 1.0, 0.25], [1.0, 1.0, 0.25, 3.0, 1.0], [1.0, float("nan"), 0.25, 3.0],
                     [1.0, 1.0, 0.25, float("inf")], [1.0, "1", 0.25, 3.0], [True, 1.0, 0.25, 3.0], 0.25,
                     "1,1,0.25,3", [])],
    ({"tooltrie": {"artifact": "{name}", "k": 2, "prior": [0.0] * 47, "query": "weather",
                   "follow": {"covered": 0.25}}}, "extra_args['tooltrie']: 'follow' must be four finite numbers"),
    ({"tooltrie_artifact": "{name}", "tooltrie_k": 2, "tooltrie_prior": [0.0] * 47, "tooltrie_query": "weather",
      "tooltrie_follows": [1.0, 1.0, 0.25, 3.0]}, "unknown key 'tooltrie_follows'"),
]


def test_a_prior_travels_flat_or_nested_with_its_weight(name: str) -> None:
    """A prior is sent as the base64 of its float32 values, whole to the bit; a list of numbers is read too."""
    prior = np.arange(47, dtype=np.float32) / 47  # the float32 values a Prior holds
    flat = request_args(name, 2, prior=prior, model_weight=0.25, flat=True)
    assert flat["tooltrie_prior"].startswith("f32:") and flat["tooltrie_model_weight"] == 0.25
    expected = RequestArgs(artifact=name, k=2, prior=tuple(prior.tolist()), model_weight=0.25)
    for extra in (flat, request_args(name, 2, prior=prior, model_weight=0.25),
                  {"tooltrie_artifact": name, "tooltrie_k": 2, "tooltrie_prior": prior.tolist(),
                   "tooltrie_model_weight": 0.25}):
        assert parse(extra) == expected
    assert parse(request_args(name, 2)) == RequestArgs(artifact=name, k=2)  # no prior: no ranker


def lexical_prior(query: str, prior: str = "lexical") -> Prior:
    from support.encoders import MadeUpEncoder

    return Ranker(load_registry(CATALOG_PATH), prior=prior, encoder=MadeUpEncoder()).row(query, "fused")


@pytest.mark.parametrize("prior", ["lexical", "hybrid"])
def test_how_the_prior_follows_the_answer_travels_flat_or_nested(name: str, prior: str) -> None:
    """``request_args(follow=Prior.follow)`` sends the request's text and the follow-up's four numbers, each exactly:
    the processor rebuilds the same follow-up from them (``follow_up``, ``test_vllm_rows_artifacts.py``)."""
    made = lexical_prior("the weather in Paris and the news about flights", prior)
    follow = made.follow
    assert follow is not None and made.scores is not None
    flat = request_args(name, 2, prior=made.scores, model_weight=made.model_weight, follow=follow, flat=True)
    assert flat["tooltrie_query"] == follow.query
    weights = (follow.lexical_weight, follow.later_weight, follow.covered, follow.chain_weight)
    assert flat["tooltrie_follow"] == list(weights) and follow.chain_weight > 0
    expected = RequestArgs(artifact=name, k=2, prior=tuple(made.scores.tolist()), model_weight=made.model_weight,
                           query=follow.query, follow=weights)
    nested = request_args(name, 2, prior=made.scores, model_weight=made.model_weight, follow=follow)
    assert nested["tooltrie"]["query"] == follow.query and nested["tooltrie"]["follow"] == flat["tooltrie_follow"]
    assert parse(flat) == parse(nested) == parse(json.loads(json.dumps(flat))) == expected  # as JSON carries it
    assert parse({**flat, "tooltrie_follow": [1, 2, 0, 3]}) == RequestArgs(  # ints are numbers too
        artifact=name, k=2, prior=expected.prior, model_weight=made.model_weight, query=follow.query,
        follow=(1.0, 2.0, 0.0, 3.0))
    without = request_args(name, 2, prior=made.scores, model_weight=made.model_weight, flat=True)
    assert "tooltrie_query" not in without and "tooltrie_follow" not in without
    assert parse(without) == RequestArgs(artifact=name, k=2, prior=expected.prior, model_weight=made.model_weight)
    with pytest.raises(ValueError, match=r"request_args: 'follow' without 'prior'"):
        request_args(name, 2, follow=follow)


def fill(value: Any, name: str) -> Any:
    if value == "{name}":
        return name
    if isinstance(value, dict):
        return {key: fill(item, name) for key, item in value.items()}
    return [fill(item, name) for item in value] if isinstance(value, list) else value


@pytest.mark.parametrize(("extra", "message"), BAD_EXTRA_ARGS)
def test_malformed_arguments_are_refused_naming_the_key(name: str, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse(fill(extra, name))


# --- names, not paths -----------------------------------------------------------------------------------------------


@pytest.fixture
def outside(saved_catalog_artifact: Path, artifact_root: Path, tmp_path: Path) -> Path:
    """A real artifact outside the root, and links in the root that lead to it (a file and a directory)."""
    copy = shutil.copy(saved_catalog_artifact, tmp_path / "secret.trie.safetensors")
    (artifact_root / "link-out.trie.safetensors").unlink(missing_ok=True)
    (artifact_root / "link-out.trie.safetensors").symlink_to(copy)
    (artifact_root / "dir-out").unlink(missing_ok=True)
    (artifact_root / "dir-out").symlink_to(tmp_path, target_is_directory=True)
    return Path(copy)


def refused_names(outside: Path, root: Path) -> list[str]:
    return [str(outside), "../" + outside.name, os.path.relpath(outside, root), "dir-out/" + outside.name,
            "link-out.trie.safetensors", "..", ".", "", "x/../" + outside.name, "nonexistent.trie.safetensors",
            ".hidden", "dir-out", "a" * 300, "name\x00"]


def test_paths_links_and_unknown_names_are_one_refusal_that_shows_no_path(outside: Path, artifact_root: Path) -> None:
    messages = set()
    for bad in refused_names(outside, artifact_root):
        with pytest.raises(ValueError, match=r"^extra_args: unknown artifact name ") as info:
            parse({"tooltrie_artifact": bad, "tooltrie_k": 1})
        messages.add(str(info.value).replace(vllm_rows._shown(bad), "NAME", 1))
    assert messages == {"extra_args: unknown artifact name NAME (a file name in the processor's artifact root, "
                        "$TOOLTRIE_ARTIFACT_ROOT)"}


def test_a_link_within_the_root_is_its_target(name: str, artifact_root: Path) -> None:
    (artifact_root / "alias.trie.safetensors").unlink(missing_ok=True)
    (artifact_root / "alias.trie.safetensors").symlink_to(artifact_root / name)
    assert parse({"tooltrie_artifact": "alias.trie.safetensors", "tooltrie_k": 2}) is not None


@pytest.mark.parametrize("content", [b"not an artifact", None])  # None: the processor's own lexical index file
def test_a_file_of_the_root_that_is_no_artifact_is_refused_as_an_unknown_name(
        name: str, artifact_root: Path, content: bytes | None, caplog: pytest.LogCaptureFixture) -> None:
    """Read once, then remembered as failed (FAILED_TTL_S); refused in the very words of a name that is not there,
    so a client learns nothing of what the root holds; why, in the log only."""
    if content is None:
        parse(request_args(name, 2, **_follow_of(name), flat=True))  # makes the lexical index beside the artifact
        bad = name.removesuffix(".safetensors") + ".lexical.safetensors"
        assert (artifact_root / bad).is_file()
    else:
        bad = "garbage.trie.safetensors"
        (artifact_root / bad).write_bytes(content)
    loads = vllm_rows.ARTIFACTS.loads
    for _ in range(3):
        with pytest.raises(ValueError) as info:
            parse({"tooltrie_artifact": bad, "tooltrie_k": 1})
        assert str(info.value) == str(_refusal(f"never-there-{bad}")).replace(f"never-there-{bad}", bad)
        assert str(artifact_root) not in str(info.value)
    assert vllm_rows.ARTIFACTS.loads == loads + 1
    assert any(bad in record.getMessage() for record in caplog.records)


def _refusal(missing: str) -> ValueError:
    with pytest.raises(ValueError) as info:
        parse({"tooltrie_artifact": missing, "tooltrie_k": 1})
    return info.value


def _follow_of(name: str) -> dict[str, Any]:
    """``request_args``' ranked arguments for a catalog request whose prior follows its answer."""
    made = Ranker(load_registry(CATALOG_PATH), prior="lexical").row("weather and news in Paris", "fused")
    return {"prior": made.scores, "model_weight": made.model_weight, "follow": made.follow}


def test_a_failed_name_is_tried_again_after_its_time(name: str, artifact_root: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_rows, "FAILED_TTL_S", 0.0)
    late = "late-" + name
    with pytest.raises(ValueError, match="unknown artifact name"):
        parse({"tooltrie_artifact": late, "tooltrie_k": 1})
    shutil.copy(artifact_root / name, artifact_root / late)
    assert parse({"tooltrie_artifact": late, "tooltrie_k": 1}) == RequestArgs(late, 1)


def test_the_header_is_checked_before_any_array_is_read(saved_catalog_artifact: Path, catalog_artifact: Artifact,
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.numpy import save

    header = catalog_artifact.header() | {"format_version": 99}
    path = tmp_path / "other.trie.safetensors"
    path.write_bytes(save(dict(catalog_artifact.trie.arrays()), metadata={"tooltrie": json.dumps(header)}))
    read: list[str] = []
    real_open = artifact_module.safe_open

    class Counting:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.handle = real_open(*args, **kwargs)

        def __enter__(self) -> Counting:
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.handle.__exit__(*exc)

        def __getattr__(self, attribute: str) -> Any:
            if attribute == "get_tensor":
                return lambda name: read.append(name) or self.inner.get_tensor(name)
            return getattr(self.inner, attribute)

    monkeypatch.setattr(artifact_module, "safe_open", Counting)
    with pytest.raises(ArtifactError, match="version 99"):
        Artifact.load(path)
    assert read == []
    Artifact.load(saved_catalog_artifact)
    assert len(read) == len(catalog_artifact.trie.arrays())  # the wrapper does count reads
