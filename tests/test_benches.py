"""The benchmarks still run against the library, tiny: ``bench/bench_step.py``'s no-repeat twins call
``kernels/walk.py``'s ``choose_rows`` from the library's module and from its compiled variants (a change of the
walk's signatures once broke the benchmark silently), and ``bench/bench_decode.py`` drives the engine, the decoder
and Hugging Face's generate. Each also checks what it can while it runs: the "on" twins must choose the walk's own
tokens, and the engine must answer as the full head + mask does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tooltrie.eval.results import read_results

BENCH = Path(__file__).resolve().parent.parent / "bench"
TOOLTRIE_ARMS = ("tooltrie cpu", "cpu twin, no-repeat on", "cpu twin, no-repeat off", "cpu twin, no-repeat on (A/A)")


def _run(script: str, out: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))["results"]
    return results


def test_bench_step_runs_with_the_library(tmp_path):
    results = _run("bench_step.py", tmp_path / "step.json", "--registries", "catalog", "--ks", "3", "--walks", "2",
                   "--repeats", "1", "--skip-outlines", "--skip-rebuild")
    (config,) = results["configs"]
    for arm in TOOLTRIE_ARMS:
        assert config["arms"][arm]["status"] == "ok", (arm, config["arms"][arm]["status"])
    assert config["ratios"]["no-repeat overhead (answer)"] is not None


def test_bench_decode_runs_and_the_engine_answers_as_the_full_head(tmp_path):
    # The default model's architecture with random weights: no download, and the arms must still agree.
    results = _run("bench_decode.py", tmp_path / "decode.json", "--weights", "random", "--ks", "1", "--repeats", "1",
                   "--batch1-queries", "1", "--batch1-repeats", "1", "--budget-s", "20")
    assert [config["batch"] for config in results["configs"]] == [16, 1]
    for config in results["configs"]:
        assert config["b_vs_c_mismatches"] == [] and config["b_errors"] == 0, config["batch"]
        assert config["c_passes_plus_speculated_equal_decision_points"] is True, config["batch"]


def test_bench_constraint_runs_and_its_arms_agree(tmp_path):
    # Both registries, small: every step's cpu bitmask equals the reference's, mask_logits_ leaves exactly the
    # bitmask's tokens, and XGrammar (no no-repeat) allows every token we allow.
    results = _run("bench_constraint.py", tmp_path / "constraint.json", "--synthetic-size", "300", "--batches",
                   "1,4", "--steps", "24", "--repeats", "1", "--skip-vllm", "--no-xgr-cache")
    assert [(c["registry"], c["batch"]) for c in results["configs"]] == [
        ("bfcl", 1), ("bfcl", 4), ("synthetic-300", 1), ("synthetic-300", 4)]
    for config in results["configs"]:
        agreement = config["agreement"]
        assert agreement["disagreements"] == [], agreement
        steps = agreement["steps"]
        assert agreement["cpu_equals_reference"] == agreement["mask_logits_equals_bitmask"] == steps
        assert agreement["xgrammar_contains_ours"] == steps
        assert config["walks"]["resets_in_steps"] > 0 or config["batch"] == 1  # rows are reset and go on
        for arm in ("per-row reference", "batch cpu", "batch cpu + mask", "xgrammar"):
            assert config["arms"][arm]["status"] == "ok", (arm, config["arms"][arm]["status"])


def test_bench_lexical_reads_back_the_index_it_built(tmp_path, monkeypatch, capsys):
    """Run in this process, the indexes it builds and reads back recorded: every index read back from the file
    beside the artifact is the one built (its words, its matrix, its scores of the bench's queries), the JSON's
    settings are the arguments given, and its table has the one registry's row with a column per arm it ran."""
    import importlib.util

    import numpy as np

    from tooltrie.eval.datasets import load_split
    from tooltrie.lexical import LexicalIndex

    built: list[LexicalIndex] = []
    read_back: list[LexicalIndex] = []
    build, cached = LexicalIndex.build.__func__, LexicalIndex.cached.__func__

    def recorded_build(cls, registry):
        built.append(build(cls, registry))
        return built[-1]

    def recorded_cached(cls, registry, path):
        before = len(built)
        index = cached(cls, registry, path)
        if len(built) == before:  # nothing built: read from the file
            read_back.append(index)
        return index

    monkeypatch.setattr(LexicalIndex, "build", classmethod(recorded_build))
    monkeypatch.setattr(LexicalIndex, "cached", classmethod(recorded_cached))
    monkeypatch.syspath_prepend(str(BENCH))  # its own imports: _common, bench_compile
    spec = importlib.util.spec_from_file_location("bench_lexical", BENCH / "bench_lexical.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "lexical.json"
    assert bench.main(["--sizes", "300", "--repeats", "2", "--queries", "3", "--output", str(out)]) == 0

    registry = bench.synthetic_registry(300)
    reference = LexicalIndex.build(registry)  # built afresh here, as nothing above was
    queries = [q.query for q in load_split("bfcl", "validation")][:3]
    assert len(read_back) == 2 and built  # one read per repeat; the first build wrote the file
    for index in [*built, *read_back]:
        assert index._bm25.vocab_dict == reference._bm25.vocab_dict
        for name in ("data", "indices", "indptr"):
            np.testing.assert_array_equal(index._bm25.scores[name], reference._bm25.scores[name], err_msg=name)
        for query in [*queries, *reference._bm25.vocab_dict]:
            np.testing.assert_array_equal(index.scores(query), reference.scores(query), err_msg=query)

    document = json.loads(out.read_text(encoding="utf-8"))
    assert {key: document["settings"][key] for key in ("sizes", "repeats", "queries")} == {
        "sizes": "300", "repeats": 2, "queries": 3}
    (result,) = document["results"][:1]
    assert (result["registry"], result["tools"]) == (registry.name, 300)
    for arm in ("build_s", "bm25s_build_s", "read_back_s"):  # the arms that took turns, each timed once a repeat
        assert len(result[arm]["samples"]) == 2, arm
    assert len(result["query_ms"]["samples"]) == len(result["z_scores_ms"]["samples"]) == 3
    lines = capsys.readouterr().out.splitlines()
    title = lines.index("lexical prior, one core")
    header, rows = lines[title + 1], lines[title + 3:]
    rows = rows[: rows.index("")] if "" in rows else rows
    assert [row.split()[0] for row in rows if not row.startswith("wrote")] == [registry.name]
    for column in ("index build s", "bm25s's own s", "read back s"):
        assert column in header, header


def test_transfer_split_writes_the_queries_of_each_half(tmp_path):
    from tooltrie.eval.datasets import load_split, registry_path
    from tooltrie.registry import load_registry

    done = subprocess.run([sys.executable, str(BENCH / "transfer_split.py"), "--dataset", "bfcl", "-o", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = {tool.name for tool in load_registry(tmp_path / "seen.jsonl").tools}
    everything = {tool.name for tool in load_registry(registry_path("bfcl")).tools}
    assert seen < everything and len(seen) == len(everything) // 2
    for split in ("train", "validation", "test"):
        for side, keep in (("unseen", lambda tools: not seen.intersection(tools)), ("seen", seen.issuperset)):
            lines = (tmp_path / f"{side}-{split}.jsonl").read_text(encoding="utf-8").splitlines()
            kept = [(row["query"], tuple(row["tools"])) for row in map(json.loads, lines)]
            expected = [(q.query, q.tools) for q in load_split("bfcl", split) if keep(q.tools)]
            assert kept == expected and kept


def test_bfcl_equivalents_judge_test_answers_and_rescore_as_the_harness_does(monkeypatch):
    import importlib.util

    from tooltrie.eval.datasets import load_split, registry_path
    from tooltrie.registry import load_registry

    spec = importlib.util.spec_from_file_location("bfcl_equivalents", BENCH / "bfcl_equivalents.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up
    spec.loader.exec_module(module)
    # Every judgment is about a test query, names a registry tool that is not gold, and maps it to one gold tool.
    names = {tool.name for tool in load_registry(registry_path("bfcl")).tools}
    gold: dict[str, set[tuple[str, ...]]] = {}  # one text may be labelled twice ("add" and "sub")
    for labelled in load_split("bfcl", "test"):
        gold.setdefault(labelled.query, set()).add(labelled.tools)
    document = json.loads(module.JUDGMENTS.read_text(encoding="utf-8"))
    for item in document["judged"]:
        assert tuple(item["gold"]) in gold[item["query"]], item
        assert item["answered"] in names and item["answered"] not in item["gold"], item
        assert item["equivalent_to"] is None or item["equivalent_to"] in item["gold"], item
    # As labelled, the rescoring equals the harness's own scores; counting equivalents never lowers them.
    results = read_results(BENCH / "results/eval/bfcl-serve-train/results.json")
    summary = module.summarize(results, module.load_judgments())
    for arm, row in summary.items():
        for metric in module.METRICS:
            assert abs(row["labelled"][metric] - results["arms"][arm]["summary"][metric]) < 1e-9, (arm, metric)
            assert row["with_equivalents"][metric] >= row["labelled"][metric]
    assert summary["fused"]["unjudged_wrong_names"] == 0
    assert summary["fused"]["with_equivalents"]["exact"] > summary["fused"]["labelled"]["exact"]


def test_the_gpu_check_runs_every_test_that_uses_a_gpu():
    """``bench/gpu_check.sh`` is the one script run where a GPU is lent: its GPU_TESTS hold every test file that
    looks for a GPU (or the simulator), it is valid bash, its results go to bench/results/gpu/, its budget is 8
    minutes."""
    script = (BENCH / "gpu_check.sh").read_text(encoding="utf-8")
    listed = set(re.findall(r"tests/test_\w+\.py", re.search(r"GPU_TESTS=\(([^)]*)\)", script).group(1)))
    gpu_words = re.compile(r"ENABLE_CUDASIM|cuda\.is_available\(\)")
    looks_for_a_gpu = {f"tests/{path.name}" for path in sorted((BENCH.parent / "tests").glob("test_*.py"))
                       if path.name != Path(__file__).name and gpu_words.search(path.read_text(encoding="utf-8"))}
    assert looks_for_a_gpu and looks_for_a_gpu <= listed, sorted(looks_for_a_gpu - listed)
    assert all((BENCH.parent / name).is_file() for name in listed)
    assert "OUT=${OUT:-bench/results/gpu}" in script and "BUDGET_S=${BUDGET_S:-480}" in script
    checked = subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stderr
