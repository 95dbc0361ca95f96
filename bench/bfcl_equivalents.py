"""Score BFCL answers counting equivalent tools: BFCL's registry merges the tool lists of many test entries, so one
request often has several tools that answer it (``calculate_bmi`` and ``calculate_BMI``), and its label names only
the one its entry listed. ``bench/bfcl_equivalent_tools.json`` holds hand judgments of wrong answers (the criterion
is in the file); this script rescores eval results with them and prints, per arm, the exact set, top-1 and recall
as labelled and with judged equivalents counted right, and how many wrong names no judgment covers (a new run's
answers may name tools nobody judged: those stay wrong, and the count says how far the rescoring reaches).

    .venv/bin/python bench/bfcl_equivalents.py bench/results/eval/bfcl-serve-train/results.json \\
        build/eval/bfcl-retrieval/results.json -o build/bfcl-equivalents.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JUDGMENTS = Path(__file__).resolve().parent / "bfcl_equivalent_tools.json"
METRICS = ("exact", "top1", "recall")


@dataclass(frozen=True)
class Rescored:
    """One answer scored as labelled and with judged equivalents."""

    labelled: dict[str, float]
    lenient: dict[str, float]
    unjudged: int  # wrong names with no judgment


def load_judgments(path: Path = JUDGMENTS) -> dict[tuple[str, str], str | None]:
    """(query, answered tool) -> the gold tool it is equivalent to, or None when judged not equivalent."""
    document = json.loads(path.read_text(encoding="utf-8"))
    return {(item["query"], item["answered"]): item["equivalent_to"] for item in document["judged"]}


def rescore(query: str, gold: Sequence[str], predicted: Sequence[str],
            judgments: Mapping[tuple[str, str], str | None]) -> Rescored:
    """Each answered name stands for the gold tool it is or is judged equivalent to; two names standing for one
    gold tool count once (so an answer cannot name a tool and its twin for two gold tools).

    >>> judged = {("bmi?", "calculate_BMI"): "calculate_bmi", ("bmi?", "weather"): None}
    >>> rescore("bmi?", ["calculate_bmi"], ["calculate_BMI"], judged).lenient["exact"]
    1.0
    >>> rescore("bmi?", ["calculate_bmi"], ["weather"], judged).lenient["top1"], rescore(
    ...     "bmi?", ["calculate_bmi"], ["other"], judged).unjudged
    (0.0, 1)
    """
    k, gold_set = len(gold), set(gold)
    stands_for = [name if name in gold_set else judgments.get((query, name)) for name in predicted]
    unjudged = sum(name not in gold_set and (query, name) not in judgments for name in predicted)

    def metrics(names: Sequence[str | None]) -> dict[str, float]:
        covered = {name for name in names[:k] if name is not None} & gold_set
        return {"exact": float(len(covered) == k == len(names) and len(set(names)) == k),
                "top1": float(bool(names) and names[0] in gold_set),
                "recall": len(covered) / k}

    labelled = [name if name in gold_set else None for name in predicted]
    return Rescored(metrics(labelled), metrics(stands_for), unjudged)


def summarize(results: Mapping[str, Any], judgments: Mapping[tuple[str, str], str | None]) -> dict[str, Any]:
    """Per arm of one eval results file: mean labelled and lenient metrics, and the unjudged wrong names."""
    arms: dict[str, list[Rescored]] = {}
    for answer in results["answers"]:
        for arm in results["arms"]:
            if arm in answer:
                arms.setdefault(arm, []).append(
                    rescore(answer["query"], answer["gold"], answer[arm]["predicted"], judgments))
    return {arm: {"answers": len(scored),
                  "labelled": {m: sum(s.labelled[m] for s in scored) / len(scored) for m in METRICS},
                  "with_equivalents": {m: sum(s.lenient[m] for s in scored) / len(scored) for m in METRICS},
                  "unjudged_wrong_names": sum(s.unjudged for s in scored)}
            for arm, scored in arms.items()}


def main(argv: list[str] | None = None) -> int:
    from tooltrie.eval.files import json_text, write_text
    from tooltrie.eval.results import read_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="tooltrie eval results.json files (BFCL)")
    parser.add_argument("--judgments", type=Path, default=JUDGMENTS)
    parser.add_argument("-o", "--output", type=Path, help="write the table's numbers as JSON")
    args = parser.parse_args(argv)
    judgments = load_judgments(args.judgments)
    table: dict[str, Any] = {}
    print("| results | arm | exact | exact, equivalents | top-1 | top-1, equivalents | recall | recall, equivalents "
          "| unjudged wrong names |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in args.results:
        results = read_results(path)
        if results["settings"]["dataset"] != "bfcl":
            parser.error(f"{path}: answers of {results['settings']['dataset']!r}, not BFCL's")
        table[path.parent.name] = summary = summarize(results, judgments)
        for arm, row in summary.items():
            cells = [f"{100 * row[kind][m]:.1f}" for m in METRICS for kind in ("labelled", "with_equivalents")]
            print(f"| {path.parent.name} | {arm} | {' | '.join(cells)} | {row['unjudged_wrong_names']} |")
    if args.output:
        write_text(args.output, json_text({"judgments": len(judgments), "results": table}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
