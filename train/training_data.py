"""Training data regenerated from the compiled artifact: the targets are the tokens the engine would emit.

``generate_training_data`` writes a directory with ``train.jsonl``, ``validation.jsonl`` and ``meta.json``. One
record per line::

    {"query": str, "tools": [names], "k": int, "kind": str,   # "need" for a situation described (else "")
     "prompt": str, "completion": str,          # Prompt.training_text: the chat-formatted prompt, and the answer
                                                # as the assistant turn closes it (e.g. "NewsTool<|im_end|>\\n")
     "prompt_ids": [int], "completion_ids": [int]}

``prompt_ids`` is ``Prompt.ids`` (the prompt tokenized whole, the query as plain text), what the engine feeds;
``completion_ids`` is the trie path of each tool followed by the stop token, what the engine emits. Each is checked
before it is written: a ``TrieMatcher`` accepts every token and ends terminated, the ids decode to ``prompt``'s
answer (``Contract.render``) plus the stop token, and the completion text starts with exactly that. A label the
trie cannot express (unknown tool, repeats, wrong k) is a ``DatasetError`` naming file:line.

Sources: the registry's own ``examples`` and (by default) each tool's description as a query for that tool, both for
train only, and labelled query sets: a bundled set's fixed train and validation splits, or a user file split with
the seed. Any text in a bundled test split, or in an ``exclude`` file, is dropped (counted in ``meta.json``). The
output is deterministic for a given seed, and written atomically (a whole new directory replaces the old one).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tooltrie.compiler.artifact import Artifact
from tooltrie.compiler.tokenizer_info import TokenizerInfo
from tooltrie.eval.datasets import (
    BUNDLED,
    DatasetError,
    LabelledQuery,
    check_labels,
    held_out_hashes,
    load_queries,
    load_split,
)
from tooltrie.eval.files import fresh_directory_beside, replace_directory, write_text
from tooltrie.kernels.matcher import TrieMatcher
from tooltrie.progress import OnProgress
from tooltrie.registry.model import Registry
from tooltrie.serve.prompt import STYLES, Prompt
from tooltrie.train.compose import composed_examples

FORMAT = "tooltrie-training-data"
FORMAT_VERSION = 1
RECORD_KEYS = ("query", "tools", "k", "kind", "prompt", "completion", "prompt_ids", "completion_ids")


@dataclass(frozen=True)
class Sources:
    """Where the examples come from, split into train and validation, with what was dropped and why."""

    train: list[tuple[str, LabelledQuery]]  # (source name, query)
    validation: list[tuple[str, LabelledQuery]]
    dropped_held_out: int
    dropped_in_validation: int = 0  # train texts dropped because validation holds the same text


def registry_examples(registry: Registry, *, descriptions: bool = True) -> list[LabelledQuery]:
    """Each tool's ``examples`` (and its description, with ``descriptions``) as queries for that tool alone."""
    items = []
    for tool in registry.tools:
        where = tool.where or f"{registry.source or registry.name}: tool {tool.name!r}"
        items += [LabelledQuery(example, (tool.name,), where=f"{where}, example {i + 1}")
                  for i, example in enumerate(tool.examples)]
        if descriptions and tool.description.strip():
            items.append(LabelledQuery(tool.description, (tool.name,), where=f"{where}, description"))
    return items


def collect_sources(registry: Registry, queries: Sequence[str], *, seed: int = 0, validation_fraction: float = 0.05,
                    descriptions: bool = True, exclude: Sequence[str | Path] = (), compose: int = 0,
                    written: Sequence[LabelledQuery] = ()) -> Sources:
    """Gather the examples: bundled sets by name (their fixed splits), user files by path (split with ``seed``);
    with ``compose``, that many multi-tool requests composed from the registry's text (``train/compose.py``), and a
    templated request per tool, for train; ``written``: requests the model wrote (``train/self_instruct.py``), for
    train."""
    withheld = set(held_out_hashes())
    for path in exclude:
        withheld |= {item.text_hash for item in load_queries(path)}
    train: list[tuple[str, LabelledQuery]] = [("registry", item) for item in registry_examples(
        registry, descriptions=descriptions)]
    if compose:
        train += [("composed", item) for item in composed_examples(registry, n_multi=compose, seed=seed)]
    train += [("written", item) for item in written]
    validation: list[tuple[str, LabelledQuery]] = []
    for name in queries:
        if name in BUNDLED:
            train += [(name, item) for item in load_split(name, "train")]
            validation += [(name, item) for item in load_split(name, "validation")]
            continue
        copies: dict[str, list[LabelledQuery]] = {}  # split by text: a repeated query stays on one side
        for item in load_queries(name):  # held-out texts are dropped below, and counted
            copies.setdefault(item.text_hash, []).append(item)
        texts = list(copies)
        random.Random(f"{seed}:{name}").shuffle(texts)
        count = round(len(texts) * validation_fraction)
        validation += [(str(name), item) for text in texts[:count] for item in copies[text]]
        train += [(str(name), item) for text in texts[count:] for item in copies[text]]
    kept_validation = [(source, item) for source, item in validation if item.text_hash not in withheld]
    kept_train = [(source, item) for source, item in train if item.text_hash not in withheld]
    dropped = len(train) + len(validation) - len(kept_train) - len(kept_validation)
    validating = {item.text_hash for _, item in kept_validation}  # e.g. a user's query that is also an example
    trained = [(source, item) for source, item in kept_train if item.text_hash not in validating]
    return Sources(train=trained, validation=kept_validation, dropped_held_out=dropped,
                   dropped_in_validation=len(kept_train) - len(trained))


class RecordMaker:
    """Turns a labelled query into a verified training record under one artifact, tokenizer and prompt."""

    def __init__(self, artifact: Artifact, tokenizer: TokenizerInfo, prompt: Prompt) -> None:
        artifact.check_compatible(tokenizer=tokenizer, where="training data")
        self.artifact, self.tokenizer, self.prompt = artifact, tokenizer, prompt

    def record(self, item: LabelledQuery) -> dict[str, Any]:
        registry, contract = self.artifact.registry, self.artifact.contract
        check_labels([item], registry)
        prompt, completion = self.prompt.training_text(registry, contract, item.query, item.tools)
        completion_ids = self.completion_ids(item, completion)
        return {"query": item.query, "tools": list(item.tools), "k": item.k, "kind": item.kind, "prompt": prompt,
                "completion": completion,
                "prompt_ids": self.prompt.ids(self.tokenizer, registry, contract, item.query, item.k),
                "completion_ids": completion_ids}

    def completion_ids(self, item: LabelledQuery, completion: str) -> list[int]:
        """The trie path of the answer plus the stop token, verified three ways (see the module docstring)."""
        artifact, tokenizer = self.artifact, self.tokenizer
        ids = [*artifact.token_path(list(item.tools)), artifact.eos_id]
        matcher = TrieMatcher(artifact, item.k)
        for position, token in enumerate(ids):
            if not matcher.accept_token(token):
                raise DatasetError(f"{item.where}: token {token} at position {position} of the answer "
                                   f"{list(item.tools)} leaves the trie (artifact {artifact.sha256[:12]})")
        if not matcher.is_terminated() or matcher.tool_names() != list(item.tools):
            raise DatasetError(f"{item.where}: the trie read {matcher.tool_names()} from the answer "
                               f"{list(item.tools)}")
        answer = artifact.contract.render(item.tools)
        if tokenizer.decode(ids[:-1]) != answer:
            raise DatasetError(f"{item.where}: the answer's tokens decode to {tokenizer.decode(ids[:-1])!r}, "
                               f"not {answer!r}")
        if not completion.startswith(answer + tokenizer.eos_token):
            raise DatasetError(f"{item.where}: the chat template closes the answer as {completion!r}, but the "
                               f"artifact stops with {tokenizer.eos_token!r}; use a chat template whose turn ends "
                               "with the tokenizer's stop token")
        return ids


def generate_training_data(out_dir: str | Path, *, artifact: Artifact, tokenizer: TokenizerInfo,
                           queries: Sequence[str], prompt_style: str = "short", seed: int = 0,
                           validation_fraction: float = 0.05, descriptions: bool = True,
                           exclude: Sequence[str | Path] = (), compose: int = 0,
                           written: Sequence[LabelledQuery] = (),
                           progress: OnProgress | None = None) -> dict[str, Any]:
    """Write ``train.jsonl``, ``validation.jsonl`` and ``meta.json`` into ``out_dir`` (replaced atomically);
    returns the meta object. ``progress`` is told the records made so far, of both splits."""
    if prompt_style not in STYLES:
        raise DatasetError(f"unknown prompt style {prompt_style!r}; choose one of {sorted(STYLES)}")
    if not 0 <= validation_fraction < 1:
        raise DatasetError(f"the validation fraction must be at least 0 and below 1, got {validation_fraction:g}")
    registry = artifact.registry
    prompt = Prompt.style(prompt_style)
    sources = collect_sources(registry, queries, seed=seed, validation_fraction=validation_fraction,
                              descriptions=descriptions, exclude=exclude, compose=compose, written=written)
    maker = RecordMaker(artifact, tokenizer, prompt)
    splits: dict[str, list[dict[str, Any]]] = {}
    for items in (sources.train, sources.validation):
        check_labels([item for _, item in items], registry)  # every bad label before any work
    made, total = 0, len(sources.train) + len(sources.validation)
    for split, items in (("train", sources.train), ("validation", sources.validation)):
        records = []
        for _, item in items:
            records.append(maker.record(item))
            made += 1
            if progress is not None:
                progress(made, total)
        random.Random(f"{seed}:{split}").shuffle(records)
        splits[split] = records
    meta = _meta(artifact, tokenizer, prompt, prompt_style, queries, seed, validation_fraction, descriptions,
                 sources, splits)
    meta["compose"] = compose
    tmp = fresh_directory_beside(out_dir)
    for split, records in splits.items():
        write_text(tmp / f"{split}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    write_text(tmp / "meta.json", json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    replace_directory(tmp, out_dir)
    return meta


def _meta(artifact: Artifact, tokenizer: TokenizerInfo, prompt: Prompt, prompt_style: str, queries: Sequence[str],
          seed: int, validation_fraction: float, descriptions: bool, sources: Sources,
          splits: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    registry, contract = artifact.registry, artifact.contract
    ks = sorted({r["k"] for records in splits.values() for r in records})
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "record_keys": list(RECORD_KEYS),
        "registry": {"name": registry.name, "source": registry.source, "sha256": registry.sha256,
                     "tools": len(registry)},
        "artifact_sha256": artifact.sha256,
        "contract": contract.to_dict(),
        "contract_sha256": contract.sha256,
        "tokenizer": {"source": tokenizer.source, "fingerprint": tokenizer.fingerprint,
                      "eos_token": tokenizer.eos_token, "eos_id": tokenizer.eos_id},
        "prompt": {"style": prompt_style, "system": prompt.system,
                   "system_text": {str(k): prompt.system_text(registry, contract, k) for k in ks}},
        "seed": seed,
        "validation_fraction": validation_fraction,
        "queries": [str(q) for q in queries],
        "descriptions": descriptions,
        "counts": {
            "train": len(splits["train"]),
            "validation": len(splits["validation"]),
            "dropped_held_out": sources.dropped_held_out,
            "dropped_in_validation": sources.dropped_in_validation,
            "by_source": {split: dict(Counter(source for source, _ in items))
                          for split, items in (("train", sources.train), ("validation", sources.validation))},
            "by_k": {split: {str(k): n for k, n in sorted(Counter(r["k"] for r in records).items())}
                     for split, records in splits.items()},
        },
    }
