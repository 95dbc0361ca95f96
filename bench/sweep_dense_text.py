"""Choose what the dense score embeds of a tool, leave one registry out: the name as written or split into its
words (``get_movie_now_playing`` -> "get movie now playing", ``Nager_Date_CountryCountryInfo`` -> "nager date
country country info": a sentence encoder's word pieces read identifiers poorly), with the tool's parameters or
without.

1. The prior: scored as the hybrid (z(dense) + 0.15 z(lexical), the top k) and as dense retrieval alone, on the
   five development registries' plain and need-describing validation requests (the mean of the two kinds'
   exact-set rates, every registry counted once); each registry's choice is made on the other four, then scored on
   its test requests, paired with today's text.
2. The served answer: today's text and the one 1 chooses on all five registries, by ``served_choice.py`` (the
   fused ranker, ``tooltrie eval`` runs kept under ``--work``; a run costs a minute or two, most of it loading).

Prints tables and writes JSON.

    cd bench && ../.venv/bin/python sweep_dense_text.py
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO_DIR, print_table, write_results
from served_choice import CRITERION, Candidate, choose
from sweep_fusion_adaptive import NEEDS
from sweep_prior_loro import CACHE, REGISTRIES, fuse, paired, per_query_rates

from tooltrie.eval.datasets import LabelledQuery, load_split, registry_path
from tooltrie.lexical import LexicalIndex, identifier_words
from tooltrie.ranker import HYBRID
from tooltrie.registry import load_registry
from tooltrie.registry.model import Tool
from tooltrie.retrieval import SentenceEncoder, tool_text

KINDS = ("plain", "need")
SPLITS = ("validation", "test")


def _name_words(tool: Tool) -> str:
    return " ".join(identifier_words(tool.name))


def _described(name: str, tool: Tool) -> str:
    return f"{name}: {tool.description}" if tool.description.strip() else name


def _without_parameters(tool: Tool) -> str:
    return _described(tool.name, tool)


def _words_without_parameters(tool: Tool) -> str:
    return _described(_name_words(tool), tool)


def _words_with_parameters(tool: Tool) -> str:
    text = tool_text(tool)
    return _name_words(tool) + text[len(tool.name):]


TEXTS: dict[str, Callable[[Tool], str]] = {
    "name, parameters (today)": tool_text,
    "name words, parameters": _words_with_parameters,
    "name": _without_parameters,
    "name words": _words_without_parameters,
}
TODAY = "name, parameters (today)"
# Runs tooltrie eval with the tools embedded as text argv[1]; another text's embeddings are kept under another key.
RUNNER = ("import sys; sys.path.insert(0, 'bench'); import sweep_dense_text as s; from tooltrie import retrieval; "
          "retrieval.tool_text = s.TEXTS[sys.argv[1]]; "
          "retrieval.TEXT_VERSION += '' if sys.argv[1] == s.TODAY else ' ' + sys.argv[1]; "
          "from tooltrie.cli import main; sys.exit(main(sys.argv[2:]))")


def _embedded(encoder: SentenceEncoder, texts: list[str]) -> np.ndarray:
    """The texts' embeddings, cached under build/ by their digest."""
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:20]
    path = CACHE / f"texts-{digest}.npy"
    if path.is_file():
        return np.load(path)
    embeddings = encoder.encode(texts).numpy().astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, embeddings)
    return embeddings


def registry_rates(name: str, encoder: SentenceEncoder) -> dict[str, Any]:
    """Per text, kind, split and arm: each request's exact set and recall@k (0-1 arrays)."""
    registry = load_registry(registry_path(REGISTRIES[name][0]))
    index = LexicalIndex.build(registry)
    queries: dict[tuple[str, str], list[LabelledQuery]] = {}
    for split in SPLITS:
        queries["plain", split] = [q for dataset in REGISTRIES[name] for q in load_split(dataset, split)]
        queries["need", split] = list(load_split(NEEDS[name], split))
    # The requests' embeddings and lexical scores do not depend on the tool text: made once.
    embedded = {key: _embedded(encoder, [q.query for q in asked]) for key, asked in queries.items()}
    lexical_scores = {key: np.array([index.scores(q.query) for q in asked], np.float32).reshape(len(asked),
                                                                                               len(registry))
                      for key, asked in queries.items()}
    rates: dict[str, Any] = {}
    for text, make in TEXTS.items():
        tools = _embedded(encoder, [make(tool) for tool in registry.tools])
        for (kind, split), asked in queries.items():
            dense, lexical = embedded[kind, split] @ tools.T, lexical_scores[kind, split]
            for arm, scores in (("dense", dense), ("hybrid", fuse(dense, lexical, "z", HYBRID["lexical"]))):
                found = per_query_rates(scores, asked, registry.names)
                rates.setdefault(text, {}).setdefault(kind, {}).setdefault(split, {})[arm] = {
                    "exact": found["exact"], "recall": found["recall"]}
    return rates


def mean_of_kinds(rates: dict[str, Any], text: str, arm: str, split: str) -> float:
    return float(np.mean([rates[text][kind][split][arm]["exact"].mean() for kind in KINDS]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO_DIR / "build" / "sweep-dense-text")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("-o", "--output", default=None, help="JSON file (default bench/results/sweep-dense-text.json)")
    args = parser.parse_args(argv)
    encoder = SentenceEncoder()
    rates = {name: registry_rates(name, encoder) for name in REGISTRIES}

    results: dict[str, Any] = {"validation": {}, "folds": {}, "test": {}}
    for arm in ("dense", "hybrid"):
        rows = []
        for text in TEXTS:
            scores = {name: mean_of_kinds(rates[name], text, arm, "validation") for name in REGISTRIES}
            results["validation"].setdefault(arm, {})[text] = scores
            rows.append({"dense text": text, **{name: round(100 * v, 1) for name, v in scores.items()},
                         "mean": round(100 * float(np.mean(list(scores.values()))), 1)})
        print_table(rows, title=f"{arm}: validation, mean of the plain and need-describing exact-set rates (%)")

    rows = []
    for held_out in REGISTRIES:
        others = [name for name in REGISTRIES if name != held_out]
        chosen = max(TEXTS, key=lambda text: (
            np.mean([results["validation"]["hybrid"][text][name] for name in others]), text == TODAY))
        results["folds"][held_out] = chosen
        for kind in KINDS:
            new, old = (rates[held_out][text][kind]["test"]["hybrid"]["exact"] for text in (chosen, TODAY))
            difference = paired(new, old, seed=(len(results["folds"]), KINDS.index(kind)))
            results["test"].setdefault(held_out, {})[kind] = {
                "chosen": float(new.mean()), "today": float(old.mean()), "n": len(new), "chosen - today": difference}
            rows.append({"held out": held_out, "chosen on the other four": chosen, "kind": kind, "n": len(new),
                         "hybrid, chosen": round(100 * new.mean(), 1), "hybrid, today": round(100 * old.mean(), 1),
                         "chosen - today (95 %), better / worse":
                             f"{100 * difference['difference']:+.1f} ({100 * difference['low']:+.1f} to "
                             f"{100 * difference['high']:+.1f}), {difference['better']} / {difference['worse']}"})
    overall = max(TEXTS, key=lambda text: (
        np.mean([results["validation"]["hybrid"][text][name] for name in REGISTRIES]), text == TODAY))
    results["all five"] = overall
    print_table(rows, title="Test, exact set (%)")
    print(f"all five choose: {overall}")
    served = list(dict.fromkeys((TODAY, overall)))
    results["served"] = choose({text: Candidate((text,), text.replace(" ", "-").replace(",", "")) for text in served},
                               RUNNER, args.work, args.batch)
    write_results("sweep-dense-text", settings={
        "texts": list(TEXTS), "arms": ["dense", "hybrid", "fused (served)"], "batch": args.batch,
        "criterion": "mean over the other four registries of the mean of the plain and need-describing validation "
                     "exact-set rates: the hybrid prior (1), the served answer (2)", "served criterion": CRITERION},
        results=results, out=args.output, compact=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
