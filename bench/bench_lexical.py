"""The lexical prior's cost (``tooltrie/lexical.py``): building the BM25 index of a registry (the words split out of
every tool, then the BM25 matrix), reading it back from the file kept beside the artifact, and scoring one query
(BM25 over every tool, then the z-scores the prior uses), and how the prior follows the answer
(``ranker.FollowUp``): making it when the request is admitted (the first prior's lexical part taken out), then
the prior of the next tool once the answer has committed to one tool and to two (the request's words rescored,
z-scored again), on one core. Beside the build, taking turns with it: the
straightforward build of the same index (each tool's ``tool_words``, then bm25s's own ``BM25.index``).

Registries: BFCL's 1,853 tools, then synthetic ones of 10,000 and 100,000 tools (``bench_compile.synthetic_names``,
each with a one-sentence description and two parameters made from the name's words and a pool of phrases, about
the size of a typical OpenAI tool). Queries: BFCL's validation requests. Targets (reported, never asserted): an
index of 100,000 tools in at most 2 s, a query's scores in a few milliseconds.

Then, at the last size (the largest, by default), the pre-filter's top N by those scores (``serve/prefilter.py``,
``Prefilter.top``) for N = 64 and 256, over every tool and over a random half of them (a tenant's allowed set), two
arms taking turns on each query's scores: ``sorted``, the rule ``top`` followed before (a set of every tool built
per request, then a Python sort of the allowed ones by ``(-score, tool id)``), and ``arrays``, ``top`` now (a
partition, the ties at the N-th score to the lower ids). Both keep the same tools (checked on every query).

    NUMBA_NUM_THREADS=1 python bench/bench_lexical.py [--sizes 1853,10000,100000] [--repeats 5] [--top-n 64,256]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from _common import Arm, median, print_table, summarize, take_turns, write_results
from bench_compile import synthetic_names

from tooltrie.chains import Chains
from tooltrie.eval.datasets import load_split
from tooltrie.lexical import BM25_PARAMETERS, LexicalIndex, tool_words
from tooltrie.ranker import FOLLOW, FollowUp, standardized
from tooltrie.registry import BFCL_PATH, Registry, load_registry, make_registry
from tooltrie.serve.prefilter import Prefilter

TARGETS = {"index_s_at_100k": 2.0, "query_ms_at_100k": 5.0, "follow_up_ms_at_100k": 1.0}
_PHRASES = ("for a given date range", "and returns the matching records", "with optional filters",
            "in the user's account", "as a paginated list", "by its identifier", "for the current user",
            "and sends a notification", "in the requested currency", "from the connected service")


def synthetic_registry(size: int, seed: int = 0) -> Registry:
    """``size`` tools with realistic names, a description and two described parameters each: a required
    identifier of the tool's domain (for the tools that search or find, about 8 %, a required query instead: the
    registry has chains, ``tooltrie/chains.py``) and a limit."""
    rng = random.Random(seed)
    tools = []
    for name in synthetic_names(size, seed):
        domain, _, action = name.partition(".")
        words = action.replace("_", " ")
        first = ({"name": "query", "description": "What to look for.", "required": True}
                 if "search" in action or "find" in action else
                 {"name": f"{domain}_id", "description": f"The {domain} account to use.", "required": True})
        tools.append({"name": name, "description": f"{words.capitalize()} in {domain} {rng.choice(_PHRASES)}.",
                      "parameters": [first, {"name": "limit", "description": "How many results to return at most."}]})
    return make_registry(tools, name=f"synthetic-{size}")


def bm25s_build(registry: Registry) -> None:
    """The straightforward build, for comparison: each tool's words, numbered as they come, then bm25s's index."""
    import bm25s

    vocabulary: dict[str, int] = {}
    documents = [[vocabulary.setdefault(w, len(vocabulary)) for w in tool_words(tool)] for tool in registry.tools]
    bm25s.BM25(**BM25_PARAMETERS).index((documents, vocabulary), create_empty_token=False, show_progress=False)


def sorted_top(n_tools: int, n: int, within: frozenset[int] | None, scores: Any) -> frozenset[int]:
    """The pre-filter's top n as it was: a set of every tool when nothing narrows the request, then a Python sort of
    the allowed tools by (-score, tool id)."""
    allowed = frozenset(range(n_tools)) if within is None else within
    if len(allowed) <= n:
        return allowed
    return frozenset(sorted(allowed, key=lambda tool: (-float(scores[tool]), tool))[:n])


def bench_top(registry: Registry, index: LexicalIndex, queries: list[str], top_n: list[int],
              seed: int = 0) -> list[dict[str, Any]]:
    """The pre-filter's top N by each query's lexical prior, the sorted rule and the arrays taking turns."""
    prefilter, n_tools = Prefilter(), len(registry)
    half = frozenset(random.Random(seed).sample(range(n_tools), n_tools // 2))
    priors = [standardized(index.scores(query)[None, :])[0] for query in queries]
    rows = []
    for within_name, within in (("every tool", None), ("a random half", half)):
        for n in top_n:
            samples: dict[str, list[float]] = {"sorted": [], "arrays": []}
            for query, scores in zip(queries, priors, strict=True):
                arms: dict[str, Arm] = {"sorted": partial(sorted_top, n_tools, n, within, scores),
                                        "arrays": partial(prefilter.top, registry, n, scores=scores,
                                                          within=within)}
                if arms["sorted"]() != arms["arrays"]():
                    raise RuntimeError(f"the arms disagree on {query!r} (N={n}, {within_name})")
                for name, times in take_turns(arms, repeats=1).items():
                    samples[name] += times.samples["wall"]
            ms = {name: [1000 * s for s in values] for name, values in samples.items()}
            rows.append({"tools": n_tools, "within": within_name, "N": n, "sorted ms": median(ms["sorted"]),
                         "arrays ms": median(ms["arrays"]), "sorted / arrays": median(ms["sorted"]) /
                         median(ms["arrays"]), "samples_ms": {name: summarize(values) for name, values in ms.items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1853,10000,100000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--queries", type=int, default=100, help="BFCL validation requests timed per registry")
    parser.add_argument("--top-n", default="64,256", help="the pre-filter's N, timed at the largest size")
    parser.add_argument("-o", "--output", default=None, help="JSON file (default bench/results/lexical.json)")
    args = parser.parse_args(argv)

    queries = [q.query for q in load_split("bfcl", "validation")][: args.queries]
    rows, results = [], []
    for size in (int(s) for s in args.sizes.split(",")):
        registry = load_registry(BFCL_PATH) if size == 1853 else synthetic_registry(size)
        index = LexicalIndex.build(registry)  # warm: imports, the word pattern
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tools.trie.lexical.safetensors"
            LexicalIndex.cached(registry, path)
            times = take_turns({"build": lambda registry=registry: LexicalIndex.build(registry),
                                "bm25s build": lambda registry=registry: bm25s_build(registry),
                                "read back": lambda registry=registry, path=path: LexicalIndex.cached(registry, path)},
                               repeats=args.repeats)
        chains_s = median(take_turns({"chains": lambda registry=registry: Chains.build(registry.tools)},
                                     repeats=args.repeats)["chains"].samples["wall"])
        chains = Chains.build(registry.tools)
        scores, priors, made, follow_ups = [], [], [], ([], [])
        for query in queries:
            began = time.perf_counter()
            row = index.scores(query)
            middle = time.perf_counter()
            first = standardized(row[None, :])[0]
            scores.append(time.perf_counter() - began)
            priors.append(time.perf_counter() - middle)
            began = time.perf_counter()
            follow = FollowUp(first, query, index, registry.tools, 1.0, 1.0, FOLLOW["covered"], chains,
                              FOLLOW["chains"])
            made.append(time.perf_counter() - began)
            chosen = tuple(int(t) for t in (-first).argsort(kind="stable")[:2])
            for n, samples in zip((1, 2), follow_ups, strict=True):
                began = time.perf_counter()
                follow(chosen[:n])
                samples.append(time.perf_counter() - began)
        result = {"registry": registry.name, "tools": len(registry),
                  "build_s": summarize(times["build"].samples["wall"]),
                  "bm25s_build_s": summarize(times["bm25s build"].samples["wall"]),
                  "read_back_s": summarize(times["read back"].samples["wall"]),
                  "chains_s": chains_s, "tools_needing_an_identifier": sum(bool(n) for n in chains.needs),
                  "entities_found": len(chains.finders),
                  "query_ms": summarize([1000 * s for s in scores]),
                  "z_scores_ms": summarize([1000 * s for s in priors]),
                  "follow_up_made_ms": summarize([1000 * s for s in made]),
                  "follow_up_ms": [summarize([1000 * s for s in samples]) for samples in follow_ups]}
        results.append(result)
        rows.append({"registry": registry.name, "tools": len(registry),
                     "index build s": median(times["build"].samples["wall"]),
                     "bm25s's own s": median(times["bm25s build"].samples["wall"]),
                     "read back s": median(times["read back"].samples["wall"]),
                     "chains s": chains_s,
                     "query ms (median)": median([1000 * s for s in scores]),
                     "query ms (max)": max(1000 * s for s in scores),
                     "z-scores ms": median([1000 * s for s in priors]),
                     "follow-up made ms": median([1000 * s for s in made]),
                     "next prior ms (1st, 2nd tool)": "{:.2f}, {:.2f}".format(
                         *(median([1000 * s for s in samples]) for samples in follow_ups))})
    print_table(rows, title="lexical prior, one core")
    # The last registry's result (the largest, by default) also holds the pre-filter's top N by its prior.
    top_n = [int(n) for n in args.top_n.split(",")]
    top_rows = results[-1]["prefilter_top"] = bench_top(registry, index, queries, top_n)
    print_table([{key: value for key, value in row.items() if key != "samples_ms"} for row in top_rows],
                title="the pre-filter's top N by the lexical prior (median ms per request, arms taking turns)")
    path = write_results("lexical", settings={"sizes": args.sizes, "repeats": args.repeats,
                                              "queries": len(queries), "targets": TARGETS, "top_n": args.top_n},
                         results=results, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
