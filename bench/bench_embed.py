"""Embedding a registry's tools from cold with all-MiniLM-L6-v2 (``SentenceEncoder.encode``): the texts in batches
of their own order (``by_length=False``: each batch padded to its longest text, as before) against batches by length
(the texts sorted by their token counts: little padding), taking turns, on the machine's threads. The two give the
same vectors (the largest difference is printed).

    .venv/bin/python bench/bench_embed.py [--tools 1853] [--repeats 2]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
import torch
from _common import median, print_table, take_turns, write_results

from tooltrie.registry import BFCL_PATH, load_registry
from tooltrie.retrieval import SentenceEncoder, tool_text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", type=int, default=1853, help="the first N of BFCL's tools (default: all 1,853)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    texts = [tool_text(tool) for tool in load_registry(BFCL_PATH).tools][: args.tools]
    encoder = SentenceEncoder()
    encoder.encode(texts[:8])  # warm: the model loaded, the first passes
    gap = float((encoder.encode(texts, by_length=False) - encoder.encode(texts)).abs().max())
    times = take_turns({"in order": lambda: encoder.encode(texts, by_length=False),
                        "by length": lambda: encoder.encode(texts)}, repeats=args.repeats)
    rows = {arm: median(samples.samples["wall"]) for arm, samples in times.items()}
    print_table([{"batches": arm, "tools": len(texts), "seconds (median)": f"{seconds:.1f}",
                  "tools/s": f"{len(texts) / seconds:.0f}"} for arm, seconds in rows.items()],
                title=f"embedding {len(texts):,} tools from cold, {torch.get_num_threads()} threads")
    print(f"by length: {rows['in order'] / rows['by length']:.2f}x faster; largest difference {gap:.1e}")
    path = write_results("embed", settings={"tools": len(texts), "repeats": args.repeats,
                                            "threads": torch.get_num_threads(), "batch_size": encoder.batch_size},
                         results={"seconds": {arm: t.samples["wall"] for arm, t in times.items()},
                                  "speedup": rows["in order"] / rows["by length"], "largest_difference": gap,
                                  "same_vectors": bool(np.isclose(gap, 0.0, atol=1e-5))},
                         out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
