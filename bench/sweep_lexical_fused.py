"""Choose between lexical scores by the answers that are served: the fused ranker's (the shipped adapter at the
weights ``--ranker auto`` gives it), leave one registry out. ``bench/sweep_names_first.py`` chooses the lexical
score's constants by the lexical arm alone, whose optimum over k1 and b is flat (a third of a point between its
best settings); the answer a user gets is the model's re-ranking of a prior with the lexical score a 0.15 share in
it, so the candidates it leaves close are decided here, on what is served.

The choice, leave one registry out, is ``served_choice.py``'s, paired against the lexical score before. Each
``tooltrie eval`` run is kept under ``--work`` and not run again when its results are there. Prints tables and
writes JSON.

    .venv/bin/python bench/sweep_lexical_fused.py -o bench/results/sweep-lexical-fused.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import REPO_DIR, write_results
from served_choice import CRITERION, PLAIN, Candidate, choose
from sweep_fusion_adaptive import NEEDS

# name: (stop words, b); k1 3 and the name's words three times in each. The first is the score before.
SETTINGS = {"Lucene's stop words, b 0.5": ("lucene", 0.5),
            "conversational stop words, b 0.75": ("conversational", 0.75),
            "conversational stop words, b 0.5": ("conversational", 0.5)}
CANDIDATES = {name: Candidate((stop, str(b)), f"{stop}-b{b:g}") for name, (stop, b) in SETTINGS.items()}
# Runs tooltrie eval with the lexical score's stop words and b set to a candidate's (argv[1], argv[2]).
RUNNER = ("import sys; from tooltrie import chains, lexical as lx; words = lx.LUCENE_STOPWORDS; "
          "words = words if sys.argv[1] == 'lucene' else words | lx.CONVERSATIONAL_STOPWORDS; "
          "lx.STOPWORDS = chains.STOPWORDS = words; lx.BM25_PARAMETERS['b'] = float(sys.argv[2]); "
          "from tooltrie.cli import main; sys.exit(main(sys.argv[3:]))")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO_DIR / "build" / "sweep-lexical-fused")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("-o", "--output", default=None,
                        help="JSON file (default bench/results/sweep-lexical-fused.json)")
    args = parser.parse_args(argv)
    results = choose(CANDIDATES, RUNNER, args.work, args.batch)
    settings = {"registries": PLAIN, "needs": NEEDS, "candidates": {c: {"stop words": s, "b": b, "k1": 3, "name": 3}
                                                                     for c, (s, b) in SETTINGS.items()},
                "batch": args.batch, "arm": "fused (the shipped adapter, the registry's weights)",
                "criterion": CRITERION}
    path = write_results("sweep-lexical-fused", settings=settings, results=results, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
