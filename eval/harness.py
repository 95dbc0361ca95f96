"""The evaluation harness: labelled queries through each arm, scored through the contract, summarised per arm.

Queries are grouped by k (the prompt names k) and answered in batches of ``EvalSetup.batch_size``; arms take turns
batch by batch, so a load spike on a shared machine hits every arm alike. **Latency** is a batch's wall time divided
by its size (ms per answer, amortised; with ``batch_size=1`` the plain latency of one answer), the same for every arm.
Besides the scores, each answer's tokens are replayed through the trie (``trie_accepted``: the trie would have
produced exactly these tokens), which shows what a string-level grammar lets through. Where the queries are of more
than one kind (plainly worded and need-describing, ``LabelledQuery.kind``), every arm is also summarised per kind
(``by_kind``).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from tooltrie.eval.backends import Arm, EvalSetup, Prediction, make_arm
from tooltrie.eval.datasets import LabelledQuery
from tooltrie.eval.results import FORMAT, VERSION
from tooltrie.eval.scoring import Outcome, score, summarize
from tooltrie.kernels.matcher import TrieMatcher
from tooltrie.progress import Progress

PLAIN = "plain"  # the kind of a query that has none: worded like the registry


@dataclass
class ArmResult:
    outcomes: list[Outcome]
    predictions: list[Prediction]
    latencies_ms: list[float]
    trie_accepted: list[bool]

    def summary(self, indices: Sequence[int] | None = None) -> dict[str, Any]:
        chosen = range(len(self.outcomes)) if indices is None else indices
        summary = summarize([self.outcomes[i] for i in chosen], [self.latencies_ms[i] for i in chosen])
        accepted = [self.trie_accepted[i] for i in chosen]
        summary["trie_accepted"] = sum(accepted) / len(accepted) if accepted else None
        return summary


def evaluate(queries: Sequence[LabelledQuery], arms: Sequence[str], setup: EvalSetup, *, progress: bool = True,
             meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every arm over ``queries``; returns the results object (``report.write_results`` saves it)."""
    if not queries:
        raise ValueError("no queries to evaluate")
    runners: dict[str, Arm] = {name: make_arm(name, setup) for name in arms}
    results = {name: ArmResult([None] * len(queries), [None] * len(queries),  # type: ignore[list-item]
                               [0.0] * len(queries), [False] * len(queries)) for name in arms}
    batches = _batches(queries, setup.batch_size)
    names = set(setup.artifact.registry.names)
    contract = setup.artifact.contract
    show, done = Progress("eval", unit="answer", quiet=not progress), 0
    for batch in batches:
        items = [queries[i] for i in batch]
        for name, arm in runners.items():
            started = time.perf_counter()
            predictions = arm.predict(items)
            per_answer = (time.perf_counter() - started) * 1e3 / len(items)
            for i, prediction in zip(batch, predictions, strict=True):
                result = results[name]
                result.predictions[i] = prediction
                result.outcomes[i] = score(prediction.text, queries[i].tools, names=names, contract=contract)
                result.latencies_ms[i] = per_answer
                result.trie_accepted[i] = trie_accepts(setup, prediction.token_ids, queries[i].k)
            done += len(items)
            show(done, len(queries) * len(arms))
    return _results_object(queries, results, setup, meta or {})


def trie_accepts(setup: EvalSetup, token_ids: Sequence[int], k: int) -> bool:
    """Whether the trie produces exactly these tokens: each one legal in turn, ending with the stop token."""
    matcher = TrieMatcher(setup.artifact, k)
    return all(matcher.accept_token(int(t)) for t in token_ids) and matcher.is_terminated()


def by_kind(queries: Sequence[LabelledQuery]) -> dict[str, list[int]]:
    """The queries' indices per kind ("plain" for a query without one, "need" for a need-describing request), kinds
    in sorted order: the groups every arm is reported in when a run holds more than one.

    >>> by_kind([LabelledQuery("weather in Lisbon", ("WeatherTool",)),
    ...          LabelledQuery("pack an umbrella?", ("WeatherTool",), kind="need")])
    {'need': [1], 'plain': [0]}
    """
    groups: dict[str, list[int]] = {}
    for i, query in enumerate(queries):
        groups.setdefault(query.kind or PLAIN, []).append(i)
    return dict(sorted(groups.items()))


def _batches(queries: Sequence[LabelledQuery], size: int) -> list[list[int]]:
    """Indices in batches of at most ``size`` queries sharing a k, in order of k, then of the queries."""
    by_k: dict[int, list[int]] = {}
    for i, query in enumerate(queries):
        by_k.setdefault(query.k, []).append(i)
    return [group[start : start + size] for _, group in sorted(by_k.items())
            for start in range(0, len(group), size)]


def _results_object(queries: Sequence[LabelledQuery], results: dict[str, ArmResult], setup: EvalSetup,
                    meta: dict[str, Any]) -> dict[str, Any]:
    ks = sorted({q.k for q in queries})
    kinds = by_kind(queries)
    artifact = setup.artifact
    arms = {name: {"summary": result.summary(),
                   "by_k": {str(k): result.summary([i for i, q in enumerate(queries) if q.k == k]) for k in ks},
                   **({"by_kind": {kind: result.summary(chosen) for kind, chosen in kinds.items()}}
                      if len(kinds) > 1 else {})}
            for name, result in results.items()}
    if "engine" in results:  # the other engines given the same prompt ids: greedy, they should answer the same
        engine = results["engine"].predictions
        for name, result in results.items():
            if name != "engine":
                same = [a.text == b.text for a, b in zip(result.predictions, engine, strict=True)]
                arms[name]["summary"]["same_as_engine"] = sum(same) / len(same)
    return {
        "format": FORMAT,
        "version": VERSION,
        "settings": {
            **meta,
            "queries": len(queries),
            "ks": ks,
            "kinds": list(kinds),
            "batch_size": setup.batch_size,
            "max_new_tokens_unconstrained": setup.max_new_tokens,
            "registry": {"name": artifact.registry.name, "sha256": artifact.registry.sha256,
                         "tools": len(artifact.registry)},
            "artifact_sha256": artifact.sha256,
            "contract_sha256": artifact.contract.sha256,
            "tokenizer": {"source": setup.tokenizer.source, "fingerprint": setup.tokenizer.fingerprint},
            "prompt_system": setup.prompt.system,
        },
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "versions": _versions()},
        "arms": arms,
        "answers": [
            {"query": q.query, "gold": list(q.tools), "where": q.where, **({"kind": q.kind} if q.kind else {}),
             **{name: {"text": r.predictions[i].text, "predicted": list(r.outcomes[i].predicted),
                       "finish_reason": r.predictions[i].finish_reason, "valid": r.outcomes[i].valid,
                       "exact": r.outcomes[i].exact, "trie_accepted": r.trie_accepted[i]}
                for name, r in results.items()}}
            for i, q in enumerate(queries)
        ],
    }


def _versions() -> dict[str, str]:
    found = {}
    for name in ("tooltrie", "torch", "transformers", "tokenizers", "xgrammar", "vllm", "numpy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found
