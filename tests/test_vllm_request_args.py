"""A request's tooltrie arguments in vLLM's ``SamplingParams.extra_args``, without vLLM: the nested form
(``{"tooltrie": {"artifact", "k"}}``) and the flat one (``tooltrie_artifact``, ``tooltrie_k``, what vLLM's OpenAI
server can carry in ``vllm_xargs``) mean the same request; malformed ones are refused with an error naming the key."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tooltrie.integrations.vllm_rows import RequestArgs, parse_request_args, request_args


def parse(extra: dict[str, Any] | None, **fields: Any) -> RequestArgs | None:
    return parse_request_args(SimpleNamespace(extra_args=extra, **fields))


@pytest.mark.parametrize("k", [1, 3, 47])
def test_nested_and_flat_forms_are_the_same_request(saved_catalog_artifact: Path, k: int) -> None:
    nested, flat = request_args(saved_catalog_artifact, k), request_args(saved_catalog_artifact, k, flat=True)
    assert flat == {"tooltrie_artifact": str(saved_catalog_artifact), "tooltrie_k": k}
    assert parse(nested) == parse(flat) == RequestArgs(str(saved_catalog_artifact), k)
    assert parse({**flat, "other_plugin": [1, 2]}) == RequestArgs(str(saved_catalog_artifact), k)


def test_requests_without_arguments_are_not_ours() -> None:
    assert parse(None) is None
    assert parse({}) is None
    assert parse({"tooltrip_k": 2, "other": {"artifact": "x"}}) is None


def test_a_thinking_budget_is_noted(saved_catalog_artifact: Path) -> None:
    args = parse(request_args(saved_catalog_artifact, 2, flat=True), thinking_token_budget=64)
    assert args is not None and args.thinking_budget


BAD_EXTRA_ARGS = [  # (extra_args, the error's words); "{path}" stands for a real artifact
    ({"tooltrie": "{path}"}, "extra_args['tooltrie'] must be"),
    ({"tooltrie": {"k": 1}}, "extra_args['tooltrie'] must be"),
    ({"tooltrie": {"artifact": "{path}", "k": "2"}}, "extra_args['tooltrie'] must be"),
    ({"tooltrie": {"artifact": "{path}", "k": 0}}, "k=0 is outside 1..47"),
    ({"tooltrie_artifact": "{path}"}, "extra_args must be"),
    ({"tooltrie_k": 2}, "extra_args must be"),
    ({"tooltrie_artifact": "{path}", "tooltrie_k": "2"}, "extra_args must be"),
    ({"tooltrie_artifact": "{path}", "tooltrie_k": 2.0}, "extra_args must be"),
    ({"tooltrie_artifact": "{path}", "tooltrie_k": True}, "extra_args must be"),
    ({"tooltrie_artifact": ["{path}"], "tooltrie_k": 2}, "extra_args must be"),
    ({"tooltrie_artifact": "{path}", "tooltrie_k": 48}, "k=48 is outside 1..47"),
    ({"tooltrie_artifact": "/nonexistent.safetensors", "tooltrie_k": 1}, "artifact not found"),
    ({"tooltrie_artifact": "{path}", "tooltrie_k": 2, "tooltrie_K": 3}, "unknown key 'tooltrie_K'"),
    ({"tooltrie_artifact": "{path}", "tooltrie_k": 2, "tooltrie": {"artifact": "{path}", "k": 2}}, "not both"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_EXTRA_ARGS)
def test_malformed_arguments_are_refused_naming_the_key(saved_catalog_artifact: Path, extra: dict[str, Any],
                                                        message: str) -> None:
    def fill(value: Any) -> Any:
        if value == "{path}":
            return str(saved_catalog_artifact)
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        return [fill(item) for item in value] if isinstance(value, list) else value

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse(fill(extra))
