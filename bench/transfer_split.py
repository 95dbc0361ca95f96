"""Split a bundled registry's tools in two seeded halves, to measure how an adapter does on tools it never saw.

Writes under OUTPUT:

- ``seen.jsonl``: the half whose text an adapter may be trained on, a registry of its own (the source's lines, as
  they are);
- ``unseen-<split>.jsonl``: the bundled set's queries of each split whose gold tools all lie in the other half.
  They are evaluated against the whole registry, so every tool stays a possible answer;
- ``seen-<split>.jsonl``: those whose gold tools all lie in the seen half, labelled queries an adapter may be trained
  on beside (or instead of) the seen half's text.

    .venv/bin/python bench/transfer_split.py --dataset bfcl -o build/transfer
    tooltrie gen-data --registry build/transfer/seen.jsonl --no-queries --compose 2000 -o build/transfer/seen-data
    tooltrie gen-data --registry build/transfer/seen.jsonl --queries build/transfer/seen-train.jsonl \
        --compose 2000 -o build/transfer/seen-labelled-data
    tooltrie eval --dataset build/transfer/unseen-test.jsonl --registry registry/bfcl.jsonl --arms retrieval,fused ...
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tooltrie.eval.datasets import load_split, registry_path
from tooltrie.eval.files import write_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="bfcl", help="a bundled set whose registry is split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)

    lines = [line for line in registry_path(args.dataset).read_text(encoding="utf-8").splitlines() if line.strip()]
    names = [json.loads(line)["name"] for line in lines]
    shuffled = sorted(names)
    random.Random(f"transfer:{args.seed}").shuffle(shuffled)
    seen = set(shuffled[: len(shuffled) // 2])
    write_text(args.output / "seen.jsonl", "".join(line + "\n" for line, name in zip(lines, names, strict=True)
                                                   if name in seen))
    counts: dict[str, dict[str, int]] = {"unseen": {}, "seen": {}}
    for split in ("train", "validation", "test"):
        queries = load_split(args.dataset, split)
        for side, kept in (("unseen", [q for q in queries if not seen.intersection(q.tools)]),
                           ("seen", [q for q in queries if seen.issuperset(q.tools)])):
            write_text(args.output / f"{side}-{split}.jsonl",
                       "".join(json.dumps({"query": q.query, "tools": list(q.tools)}) + "\n" for q in kept))
            counts[side][split] = len(kept)
    print(f"{args.output}: {len(seen)} of {len(names)} tools seen; queries on unseen tools only: {counts['unseen']}, "
          f"on seen tools only: {counts['seen']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
