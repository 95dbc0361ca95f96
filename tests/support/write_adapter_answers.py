"""Write ``adapter_answers.json``, the held-out answers ``test_default_adapter.py`` expects of the shipped default.

Run after shipping a new adapter: ``python tests/support/write_adapter_answers.py``. It answers evenly spaced held-out
MetaTool queries (12 with k = 1, 6 with k = 2) with the default model in float32 and in bfloat16 and keeps only
queries whose answer is the same in both and decided by a clear margin (every decision at least ``MIN_MARGIN``
apart in logits), so the test does not hang on float rounding; right and wrong answers alike (``gold`` beside).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tooltrie.compiler import TokenizerInfo, compile_registry
from tooltrie.eval.datasets import load_split
from tooltrie.registry import CATALOG_PATH, load_registry
from tooltrie.serve.engine import Engine, Request
from tooltrie.serve.model import load_model
from tooltrie.serve.prompt import Prompt

OUT = Path(__file__).with_name("adapter_answers.json")
MIN_MARGIN = 0.5
WANTED = {"metatool-single": 12, "metatool-multi": 6}


def main() -> None:
    engines = []
    for dtype in (torch.float32, torch.bfloat16):
        model, info = load_model(dtype=dtype)
        tokenizer = TokenizerInfo.load(info.tokenizer)
        artifact = compile_registry(load_registry(CATALOG_PATH), tokenizer)
        engines.append(Engine(model, tokenizer, artifact, prompt=Prompt.style(info.prompt_style)))
    cases = []
    for name, wanted in WANTED.items():
        test = load_split(name, "test")
        taken = 0
        for i in range(len(test)):
            query = test[(i * 37) % len(test)]  # a stride through the split, which is grouped by gold tool
            answers = [engine.run([Request(query.query, query.k)])[0] for engine in engines]
            names = [[tool.name for tool in answer.tools] for answer in answers]
            if names[0] != names[1] or min(t.margin for a in answers for t in a.tools) < MIN_MARGIN:
                continue
            cases.append({"query": query.query, "k": query.k, "tools": names[0], "gold": list(query.tools)})
            taken += 1
            if taken == wanted:
                break
    OUT.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}: {len(cases)} answers, {sum(c['tools'] != c['gold'] for c in cases)} of them wrong")


if __name__ == "__main__":
    main()
