"""Writing an evaluation: the JSON results, a Markdown report and PNG plots, next to each other.

``write_results(results, out_dir)`` writes ``results.json`` and ``answers.jsonl`` (``tooltrie.eval.results``),
``report.md``, ``accuracy.png`` (exact-set accuracy, top-1, validity, hallucinated and repeat rates per arm) and
``latency.png`` (median and p90 ms per answer per arm). The report pairs each arm with the retrieval arm, where one
ran (``tooltrie.eval.compare``). Every file is written atomically.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from tooltrie.errors import TooltrieError
from tooltrie.eval.files import write_text as _write_text
from tooltrie.eval.results import RESULTS_FILE, write_results_files
from tooltrie.files import make_readable

TABLE_COLUMNS = (  # (key in a summary, column title, format)
    ("answers", "answers", "{:d}"),
    ("exact", "exact-set", "{:.1%}"),
    ("top1", "top-1", "{:.1%}"),
    ("recall", "recall@k", "{:.1%}"),
    ("precision", "precision", "{:.1%}"),
    ("valid", "validity", "{:.1%}"),
    ("hallucinated", "hallucinated", "{:.1%}"),
    ("repeated", "repeats", "{:.1%}"),
    ("wrong_count", "wrong count", "{:.1%}"),
    ("trie_accepted", "trie-accepted", "{:.1%}"),
    ("latency_median_ms", "median ms", "{:.1f}"),
    ("latency_p90_ms", "p90 ms", "{:.1f}"),
)
PLOTTED_RATES = (("exact", "exact-set"), ("top1", "top-1"), ("valid", "validity"),
                 ("hallucinated", "hallucinated"), ("repeated", "repeats"))


def write_results(results: dict[str, Any], out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """Write the results, the report and (unless ``plots=False``) the plots into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {**write_results_files(results, out), "report": out / "report.md"}
    if plots:
        paths["accuracy"] = out / "accuracy.png"
        paths["latency"] = out / "latency.png"
        plot_accuracy(results, paths["accuracy"])
        plot_latency(results, paths["latency"])
    _write_text(paths["report"], markdown(results, images=[p.name for k, p in paths.items() if p.suffix == ".png"]))
    return paths


def markdown(results: dict[str, Any], *, images: list[str] | None = None) -> str:
    """The report: settings, then one table row per arm (and per arm and k when there are several k, per arm and
    kind when the queries are of several kinds: plain and need-describing)."""
    settings = results["settings"]
    lines = [f"# Evaluation: {settings.get('dataset', 'queries')}", ""]
    for key in ("dataset", "split", "model", "prompt_style", "queries", "ks", "batch_size"):
        if key in settings:
            lines.append(f"- {key.replace('_', ' ')}: {settings[key]}")
    registry = settings["registry"]
    lines.append(f"- registry: {registry['name']} ({registry['tools']} tools, sha256 {registry['sha256'][:12]}), "
                 f"artifact {settings['artifact_sha256'][:12]}")
    machine = results.get("machine", {})
    if machine:
        versions = ", ".join(f"{name} {version}" for name, version in machine.get("versions", {}).items())
        lines.append(f"- machine: {machine.get('processor')}, {machine.get('platform')}, Python "
                     f"{machine.get('python')}; {versions}")
    lines += ["", "Scores are read through the contract's `parse`; latency is ms per answer (a batch's wall time / "
              "its size).", ""]
    lines += _table(results)
    if len(settings.get("ks", [])) > 1:
        lines += ["", "By k:", "", *_table(results, group="by_k")]
    if any("by_kind" in data for data in results["arms"].values()):
        lines += ["", "By kind (plain: worded like the registry; need: a situation or a goal, not the tool's words):",
                  "", *_table(results, group="by_kind")]
    same = {arm: data["summary"]["same_as_engine"] for arm, data in results["arms"].items()
            if data["summary"].get("same_as_engine") is not None}
    if same:
        lines += ["", "Answers identical to the engine arm's (same text): " + ", ".join(
            f"{arm} {share:.1%}" for arm, share in same.items()) + "."]
    paired = _against_retrieval(results)
    if paired:
        lines += ["", "Exact sets against the retrieval arm, answer by answer (`tooltrie compare`: a 95 % paired "
                  "bootstrap interval, the exact sign test):", "", *paired]
    for image in images or []:
        lines += ["", f"![{image}]({image})"]
    return "\n".join(lines) + "\n"


def _table(results: dict[str, Any], *, group: str | None = None) -> list[str]:
    """One row per arm, or with ``group`` ("by_k", "by_kind") one per arm and group."""
    head = ["arm", *([{"by_k": "k", "by_kind": "kind"}[group]] if group else []),
            *(title for _, title, _ in TABLE_COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * (2 if group else 1) + ["---:"] *
                                                            len(TABLE_COLUMNS)) + "|"]
    for arm, data in results["arms"].items():
        if group == "by_k":
            rows = sorted(data["by_k"].items(), key=lambda e: int(str(e[0])))
        else:
            rows = list(data.get(group, {}).items()) if group else [(None, data["summary"])]
        for k, summary in rows:
            cells = [arm, *([k] if group else [])]
            cells += ["-" if summary.get(key) is None else fmt.format(summary[key]) for key, _, fmt in TABLE_COLUMNS]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _against_retrieval(results: dict[str, Any]) -> list[str]:
    """A table pairing each arm with the retrieval arm; none without it or without every arm's answers."""
    from tooltrie.eval.compare import ArmAnswers, compare

    arms, answers = list(results["arms"]), results.get("answers") or []
    complete = bool(answers) and all(arm in answer for answer in answers for arm in arms)
    if "retrieval" not in arms or len(arms) < 2 or not complete:
        return []
    lines = ["| arm | exact-set | retrieval | difference (95 % interval) | arm better | retrieval better | p |",
             "|---|---:|---:|---|---:|---:|---:|"]
    where = Path(RESULTS_FILE)
    retrieval = ArmAnswers.of(results, "retrieval", where=where)
    for arm in arms:
        if arm != "retrieval":
            rows = compare(ArmAnswers.of(results, arm, where=where), retrieval, rates=["exact"])
            for row in (row for row in rows if row.k is None):  # every answer, then each kind where there are two
                label = arm if row.kind is None else f"{arm} ({row.kind})"
                lines.append(f"| {label} | {row.a:.1%} | {row.b:.1%} | {100 * row.difference:+.1f} points "
                             f"({100 * row.low:+.1f} to {100 * row.high:+.1f}) | {row.a_better} | {row.b_better} | "
                             f"{row.p:.3g} |")
    return lines


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise TooltrieError("plots need matplotlib: pip install 'tooltrie[eval]' (or pass --no-plots)") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(results: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    arms = list(results["arms"])
    width = 0.8 / len(PLOTTED_RATES)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(arms) + 2), 4))
    for j, (key, label) in enumerate(PLOTTED_RATES):
        values = [100 * (results["arms"][arm]["summary"].get(key) or 0.0) for arm in arms]
        ax.bar([i + (j - (len(PLOTTED_RATES) - 1) / 2) * width for i in range(len(arms))], values, width,
               label=label)
    ax.set_xticks(range(len(arms)), arms)
    ax.set_ylabel("% of answers")
    ax.set_ylim(0, 105)
    ax.set_title(f"{results['settings'].get('dataset', '')}: accuracy and validity per arm")
    ax.legend(fontsize="small", ncol=len(PLOTTED_RATES), loc="upper center", bbox_to_anchor=(0.5, -0.1))
    _save(fig, path)


def plot_latency(results: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    arms = list(results["arms"])
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(arms) + 2), 3.5))
    for offset, (key, label) in ((-0.2, ("latency_median_ms", "median")), (0.2, ("latency_p90_ms", "p90"))):
        values = [results["arms"][arm]["summary"].get(key) or 0.0 for arm in arms]
        ax.bar([i + offset for i in range(len(arms))], values, 0.4, label=label)
    ax.set_xticks(range(len(arms)), arms)
    ax.set_ylabel("ms per answer")
    ax.set_title(f"latency (batch {results['settings'].get('batch_size')})")
    ax.legend(fontsize="small")
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, metadata={"Software": None})
        make_readable(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)
