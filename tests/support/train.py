"""Training data made by hand for the training tests: ``tooltrie gen-data``'s format, built here independently.

A record is ``{"query", "tools", "k", "prompt", "completion", "prompt_ids", "completion_ids"}``: the prompt from
``Prompt.training_text``, its ids from the tokenizer, the completion ids read off the artifact's trie (each tool's
path, then the stop token). ``meta.json`` carries the hashes the way gen-data nests them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.serve.prompt import Prompt

# Queries for support.serve.SMALL_NAMES ("get", "get_user", "get_users", "search", "search_web", "a", "ab").
SMALL_LABELLED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Who is this user?", ("get_user",)),
    ("List every user", ("get_users",)),
    ("Look this up on the web", ("search_web",)),
    ("Find it", ("search",)),
    ("Fetch the record", ("get",)),
    ("Just a", ("a",)),
    ("Find the user on the web", ("search_web", "get_user")),
    ("All users, then search", ("get_users", "search")),
)


def make_record(artifact: Artifact, tokenizer: TokenizerInfo, query: str, tools: Sequence[str], *,
                style: str = "short") -> dict[str, Any]:
    prompt, completion = Prompt.style(style).training_text(artifact.registry, artifact.contract, query, tools)
    return {"query": query, "tools": list(tools), "k": len(tools), "prompt": prompt, "completion": completion,
            "prompt_ids": tokenizer.encode(prompt),
            "completion_ids": [*artifact.token_path(list(tools)), artifact.eos_id]}


def make_meta(artifact: Artifact, tokenizer: TokenizerInfo, *, style: str = "short") -> dict[str, Any]:
    registry = artifact.registry
    return {"format": "tooltrie-training-data", "format_version": 1,
            "registry": {"name": registry.name, "sha256": registry.sha256, "tools": len(registry)},
            "tokenizer": {"fingerprint": tokenizer.fingerprint, "source": tokenizer.source},
            "contract": artifact.contract.to_dict(), "contract_sha256": artifact.contract.sha256,
            "prompt": {"style": style}, "seed": 0}


def write_training_data(directory: Path, artifact: Artifact, tokenizer: TokenizerInfo,
                        train: Sequence[tuple[str, Sequence[str]]] = SMALL_LABELLED,
                        validation: Sequence[tuple[str, Sequence[str]]] = SMALL_LABELLED[:4]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, items in (("train", train), ("validation", validation)):
        lines = [json.dumps(make_record(artifact, tokenizer, query, tools)) for query, tools in items]
        (directory / f"{name}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    meta = make_meta(artifact, tokenizer)
    (directory / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return directory
