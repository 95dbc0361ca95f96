"""A prior that answers each ask, leave one registry out: the retrieval prior alone (no model), today's follow-up
against one tool per ask of the request.

For each request of the five development registries' validation and test splits, of four kinds (plainly worded,
need-describing, and requests that ask several things, written by hand, ``eval/data/compound/``, and joined from
single-tool requests, ``eval/composed.py``), k its gold tools:

- ``today``: the hybrid prior following the answer (``FollowUp.top``: what ``--ranker retrieval`` answers);
- ``asks b``: the request cut into its asks (``tooltrie.asks.split_asks``), each ask's tools scored by its own hybrid
  prior blended with the whole request's, ``(1 - b) * ask + b * whole`` (z-scores), one tool per ask, the best
  ask-tool pairs first (``eval.backends.one_per_ask``); past the asks, today's follow-up from the tools chosen;
- ``asks b, k>1``: the same where the answer is of two tools or more; one tool answers the whole request (today's);
- ``asks b, k>1, at most k``: the same, a request cut into more asks than its answer has tools merged down to k
  asks (the two neighbouring asks whose scores correlate most become one, their z-scores averaged);
- ``spans b, k>1``: the same, each ask's dense part pooled from the request's one encoder pass (the states of the
  ask's tokens: no pass of its own) instead of an encoder pass of its own;
- ``asks 0.25 near p``: the same at b = 0.25, each later tool's prior lowered by p times its largest cosine (the
  tools' embeddings) to a tool chosen before it: a near-duplicate of a chosen tool counts less.

The candidate with the best mean, over the other four registries, of the mean of the four kinds' validation exact-set
rates is scored on the fifth's test requests, paired against ``today``. Every ask and request of a registry is
embedded in one pass.

    .venv/bin/python bench/sweep_asks.py [--out bench/results/sweep_asks.json]
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from _common import print_table, write_results
from _study import KINDS, REGISTRIES, SETS, choose, paired

from tooltrie.asks import split_asks
from tooltrie.compiler import TokenizerInfo, compile_cached
from tooltrie.eval.backends import one_per_ask
from tooltrie.eval.datasets import LabelledQuery, load_split, registry_path
from tooltrie.eval.scoring import answer_rates
from tooltrie.ranker import HYBRID, UNTRAINED, FollowUp, PerAsk, Ranker, ranker_for, standardized
from tooltrie.registry import load_registry

BLENDS = (0.0, 0.25, 0.5, 0.75)
# A tool close to one already chosen (the cosine of their embeddings) counts ``near`` z-units less per unit of cosine,
# at the blend every fold chose without it.
NEAR = (0.5, 1.0, 2.0, 4.0)
CANDIDATES = ("today", *(f"asks {b}" for b in BLENDS), *(f"asks 0.25 near {p}" for p in NEAR),
              *(f"asks {b}, k>1" for b in BLENDS), *(f"spans {b}, k>1" for b in BLENDS),
              *(f"asks {b}, k>1, at most k" for b in BLENDS))


def answers(ranker: Ranker, queries: Sequence[LabelledQuery]) -> dict[str, list[list[int]]]:
    """Each candidate's answer to each query (tool ids, k each)."""
    asks = [split_asks(query.query) for query in queries]
    texts = [text for query, parts in zip(queries, asks, strict=True) for text in (query.query, *parts)]
    scores = ranker.prior_scores(texts, "hybrid")
    result: dict[str, list[list[int]]] = {candidate: [] for candidate in CANDIDATES}
    row = 0
    for query, parts in zip(queries, asks, strict=True):
        whole, by_ask = scores[row], scores[row + 1 : row + 1 + len(parts)]
        row += 1 + len(parts)
        follow = ranker.follow_up(query.query, whole, 1.0, "hybrid")
        if follow is None:
            raise RuntimeError("the hybrid prior follows the answer: a follow-up is expected")
        result["today"].append(follow.top(query.k))
        # the "k>1" candidates: no asks for an answer of one tool, which answers the whole request
        ask_rows = {"asks": by_ask, "asks, k>1": by_ask, "asks, k>1, at most k": _at_most(by_ask, query.k),
                    "spans, k>1": _span_scores(ranker, query.query, parts)}
        for blend in BLENDS:
            for name, rows in ask_rows.items():
                kind, _, rule = name.partition(", ")
                rows = rows if query.k > 1 or not rule else rows[:0]
                result[f"{kind} {blend}{', ' + rule if rule else ''}"].append(
                    _one_per_ask(rows, whole, blend, follow, query.k))
        per_ask = PerAsk((0.75 * by_ask + 0.25 * whole).astype(np.float32), whole, follow)
        for near in NEAR:
            result[f"asks 0.25 near {near}"].append(_near_top(per_ask, ranker.tool_embeddings, near, query.k))
    return result


def _one_per_ask(by_ask: np.ndarray, whole: np.ndarray, blend: float, follow: FollowUp, k: int) -> list[int]:
    """One tool per ask (each ask's scores blended with the request's at ``blend``), the best ask-tool pairs first
    (``one_per_ask``), then the request's follow-up from the tools chosen."""
    chosen = one_per_ask((1 - blend) * by_ask + blend * whole, k) if len(by_ask) else []
    while len(chosen) < k:
        prior = np.array(follow(tuple(chosen)), np.float64)
        prior[chosen] = -np.inf
        chosen.append(int(np.argmax(prior)))
    return chosen


def _span_scores(ranker: Ranker, query: str, asks: list[str]) -> np.ndarray:
    """Each ask's hybrid z-scores, its dense part pooled from the request's one encoder pass (its span's tokens)."""
    encoder = ranker.encoder
    encoding = encoder._tokenizer.encode(query)
    ids = torch.tensor([encoding.ids])
    with torch.inference_mode():
        hidden = encoder._model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                token_type_ids=torch.zeros_like(ids)).last_hidden_state[0]
    offsets, real = torch.tensor(encoding.offsets), torch.tensor(encoding.special_tokens_mask) == 0
    rows = []
    for start, end in _spans(query, asks):
        inside = real & (offsets[:, 0] >= start) & (offsets[:, 1] <= end)
        rows.append(hidden[inside].mean(dim=0) if bool(inside.any()) else hidden.mean(dim=0))
    embedded = torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()
    dense = standardized(embedded @ ranker.tool_embeddings.T)
    lexical = standardized(np.array([ranker.lexical.scores(ask) for ask in asks]))
    return HYBRID["dense"] * dense + HYBRID["lexical"] * lexical


def _near_top(follow: PerAsk, embeddings: np.ndarray, near: float, k: int) -> list[int]:
    """``follow``'s answer alone, each later tool's prior lowered by ``near`` times its largest cosine to a tool
    chosen before it."""
    chosen: list[int] = []
    closest = np.full(len(embeddings), -np.inf)
    for _ in range(k):
        prior = np.array(follow(tuple(chosen)), np.float64)
        if chosen:
            prior -= near * closest
            prior[chosen] = -np.inf
        chosen.append(int(np.argmax(prior)))
        closest = np.maximum(closest, embeddings @ embeddings[chosen[-1]])
    return chosen


def _at_most(by_ask: np.ndarray, k: int) -> np.ndarray:
    """At most ``k`` asks: while there are more, the two neighbouring asks whose scores correlate most become one,
    their scores averaged."""
    rows = [row for row in by_ask]
    while len(rows) > max(k, 1):
        i = max(range(len(rows) - 1), key=lambda j: float(np.corrcoef(rows[j], rows[j + 1])[0, 1]))
        rows[i : i + 2] = [(rows[i] + rows[i + 1]) / 2]
    return np.array(rows)


def _spans(text: str, asks: list[str]) -> list[tuple[int, int]]:
    """Where each ask lies in ``text``: from its first word to its last (words skipped between), in order."""
    spans, position = [], 0
    for ask in asks:
        match = re.compile(".*?".join(map(re.escape, ask.split())), re.DOTALL).search(text, position)
        spans.append((0, len(text)) if match is None else match.span())
        position = position if match is None else match.end()
    return spans


def exact(names: Sequence[str], queries: Sequence[LabelledQuery], answered: list[list[int]]) -> np.ndarray:
    return np.array([answer_rates([names[i] for i in tools], list(query.tools))["exact"]
                     for query, tools in zip(queries, answered, strict=True)], float)


def run() -> dict[str, Any]:
    tokenizer = TokenizerInfo.load()
    rates: dict[tuple[str, str, str], dict[str, np.ndarray]] = {}  # (registry, kind, split) -> candidate -> exact
    for registry, kinds in SETS.items():
        artifact = compile_cached(load_registry(registry_path(kinds["plain"][0])), tokenizer)
        ranker = ranker_for(artifact, None, UNTRAINED)
        for kind, names in kinds.items():
            for split in ("validation", "test"):
                queries = [query for name in names for query in load_split(name, split)]
                answered = answers(ranker, queries)
                rates[registry, kind, split] = {c: exact(artifact.registry.names, queries, answered[c])
                                                for c in CANDIDATES}

    def criterion(candidate: str, registries: Sequence[str]) -> float:
        return float(np.mean([np.mean([rates[r, kind, "validation"][candidate].mean() for kind in KINDS])
                              for r in registries]))

    chosen = choose(CANDIDATES, criterion)
    folds = chosen["folds"]
    results: dict[str, Any] = {**chosen, "validation": {
        c: {r: {k: round(100 * float(rates[r, k, "validation"][c].mean()), 2) for k in KINDS} for r in REGISTRIES}
        for c in CANDIDATES}, "held_out": {}, "pooled": {}}
    for i, held in enumerate(REGISTRIES):
        results["held_out"][held] = {kind: {"candidate": folds[held], "n": len(rates[held, kind, "test"]["today"]),
                                            **paired(rates[held, kind, "test"][folds[held]],
                                                     rates[held, kind, "test"]["today"], (i, j))}
                                     for j, kind in enumerate(KINDS)}
    for j, kind in enumerate(KINDS):
        ours = np.concatenate([rates[r, kind, "test"][folds[r]] for r in REGISTRIES])
        today = np.concatenate([rates[r, kind, "test"]["today"] for r in REGISTRIES])
        results["pooled"][kind] = {"n": len(ours), "chosen": float(ours.mean()), "today": float(today.mean()),
                                   **paired(ours, today, (9, j))}
    for held in REGISTRIES:
        for kind, cell in results["held_out"][held].items():
            cell["chosen"] = float(rates[held, kind, "test"][folds[held]].mean())
            cell["today"] = float(rates[held, kind, "test"]["today"].mean())
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = run()
    print_table([{"candidate": c, **{f"{r} {k}": results["validation"][c][r][k] for r in REGISTRIES for k in KINDS}}
                 for c in CANDIDATES], title="validation exact set (%), the prior alone")
    def row(held: str, kind: str, choice: str, cell: dict[str, Any]) -> dict[str, Any]:
        return {"held out": held, "kind": kind, "choice": choice, "n": cell["n"],
                "chosen": f"{100 * cell['chosen']:.1f}", "today": f"{100 * cell['today']:.1f}",
                "difference": f"{100 * cell['difference']:+.1f} ({100 * cell['low']:+.1f} to "
                              f"{100 * cell['high']:+.1f})"}

    rows = [row(held, kind, cell["candidate"], cell) for held, kinds in results["held_out"].items()
            for kind, cell in kinds.items()]
    rows += [row("pooled", kind, "folds' own", cell) for kind, cell in results["pooled"].items()]
    print_table(rows, title="test, held out: exact set (%), the fold's choice against today's follow-up")
    print(f"folds: {results['folds']}; all five: {results['all five']}")
    path = write_results("sweep_asks", settings={"candidates": CANDIDATES, "kinds": KINDS}, results=results,
                         out=args.out, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
