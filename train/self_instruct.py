"""Requests the instruct model writes for each tool (self-instruct), kept only when retrieval maps them back.

A registry's text says what a tool does, not how users ask for it. Here the bundled instruct model, without the
adapter, continues a few-shot prompt (three made-up tools, each with a request giving concrete values) with the
tool's text (``retrieval.tool_text``) and writes a request, sampled, up to the end of its line. A written request is
kept when retrieval ranks its tool among the top ``keep_top`` of the registry for it: a request the model wrote about
something else, or too vaguely to point anywhere, is dropped, and so is one that names its tool. What is kept is
labelled with its tool; the answers are trie paths like every other record's.

>>> first_lines(["  Will it rain in Oslo?\\nTool: x", "", "Tool: get_weather ..."])
['Will it rain in Oslo?', '', '']
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tooltrie.eval.datasets import LabelledQuery
from tooltrie.progress import OnProgress
from tooltrie.registry.model import Registry, Tool
from tooltrie.retrieval import tool_text

# Made-up tools (none of any bundled registry), each with a request as users write them: concrete values, no names.
SHOTS = (
    ("weather_outlook: Current weather and the forecast for a city. Parameters: city (The city's name.); days (Days "
     "ahead.)", "Will it rain in Oslo in the next 3 days?"),
    ("money_exchange: Convert an amount of money between currencies. Parameters: amount (The amount.); source "
     "(Currency code.); target (Currency code.)", "How much is 250 US dollars in euros?"),
    ("eatery_search: Find restaurants near a place. Parameters: location (Where.); cuisine (Kind of food.)",
     "Find me a sushi place near Union Square."),
)
KEEP_TOP = 10  # a written request is kept when retrieval ranks its tool among this many
MAX_NEW_TOKENS = 40
BATCH_SIZE = 32

Generate = Callable[[list[str]], list[str]]  # prompts -> continuations


def prompt_for(tool: Tool) -> str:
    """The few-shot prompt whose continuation is a request for ``tool``."""
    shots = "".join(f"Tool: {text}\nRequest: {request}\n\n" for text, request in SHOTS)
    return f"{shots}Tool: {tool_text(tool)}\nRequest:"


def first_lines(continuations: Sequence[str]) -> list[str]:
    """Each continuation's first line, stripped; empty when the model went on to another tool instead."""
    lines = [text.strip().split("\n", 1)[0].strip() for text in continuations]
    return ["" if line.startswith("Tool:") else line for line in lines]


def written_requests(registry: Registry, generate: Generate, similarities: Callable[[list[str]], Any], *,
                     per_tool: int = 1, keep_top: int = KEEP_TOP, seed: int = 0) -> tuple[list[LabelledQuery], int]:
    """``per_tool`` written requests for every tool, filtered by retrieval (``similarities``: queries -> [queries,
    tools] cosine); returns the kept ones and how many were written."""
    tools = list(registry.tools) * per_tool
    random.Random(f"self-instruct:{seed}").shuffle(tools)
    written = first_lines(generate([prompt_for(tool) for tool in tools]))
    candidates = [(tool, text) for tool, text in zip(tools, written, strict=True)
                  if text and tool.name.lower() not in text.lower()]  # a request naming its tool teaches nothing
    if not candidates:
        return [], len(tools)
    scores = np.asarray(similarities([text for _, text in candidates]))
    ids = np.array([registry.index(tool.name) for tool, _ in candidates])
    rank = (scores > scores[np.arange(len(ids)), ids][:, None]).sum(axis=1)  # tools retrieval puts above the tool
    source = registry.source or registry.name
    kept = [LabelledQuery(text, (tool.name,), where=f"{source}: written for {tool.name!r}")
            for (tool, text), above in zip(candidates, rank.tolist(), strict=True) if above < keep_top]
    return kept, len(tools)


def hf_generate(model: Any, tokenizer: Any, *, seed: int = 0, batch_size: int = BATCH_SIZE,
                max_new_tokens: int = MAX_NEW_TOKENS, sample: bool = True,
                progress: OnProgress | None = None) -> Generate:
    """A ``Generate`` writing one line per prompt with a Hugging Face causal LM: sampled (temperature 0.7, top-p 0.9,
    seeded), or greedy without ``sample``; ``progress`` told the prompts done after each batch.

    The prompts' common prefix (the few-shot part) is run once; its key/value cache is repeated for each batch of
    prompts of one length, so nothing is padded and only each tool's own text is computed.
    """
    import torch

    newline = tokenizer.encode("\n", add_special_tokens=False)
    stops = [tokenizer.eos_token_id, *newline] if len(newline) == 1 else [tokenizer.eos_token_id]
    sampling: dict[str, Any] = {"do_sample": True, "temperature": 0.7, "top_p": 0.9} if sample else {
        "do_sample": False}

    def generate(prompts: list[str]) -> list[str]:
        if not prompts:
            return []
        rows = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in prompts]
        shared = min(_common_prefix(rows), min(map(len, rows)) - 1)  # at least one token left for generate
        with torch.inference_mode():
            prefix = model(input_ids=torch.tensor([rows[0][:shared]]), use_cache=True).past_key_values
        by_length: dict[int, list[int]] = {}
        done = 0
        for i, row in enumerate(rows):
            by_length.setdefault(len(row), []).append(i)
        out = [""] * len(prompts)
        torch.manual_seed(seed)
        for length, members in sorted(by_length.items()):
            for start in range(0, len(members), batch_size):
                batch = members[start : start + batch_size]
                cache = copy.deepcopy(prefix)
                cache.batch_repeat_interleave(len(batch))
                ids = torch.tensor([rows[i] for i in batch])
                with torch.inference_mode():
                    generated = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                               max_new_tokens=max_new_tokens, eos_token_id=stops,
                                               pad_token_id=tokenizer.eos_token_id, **sampling)
                texts = tokenizer.batch_decode(generated[:, length:], skip_special_tokens=True)
                for i, text in zip(batch, texts, strict=True):
                    out[i] = text
                done += len(batch)
                if progress is not None:
                    progress(done, len(prompts))
        return out

    return generate


def _common_prefix(rows: list[list[int]]) -> int:
    first = rows[0]
    return min(next((j for j, (a, b) in enumerate(zip(first, row, strict=False)) if a != b), min(len(first), len(row)))
               for row in rows)


def default_model_requests(registry: Registry, *, per_tool: int = 1, seed: int = 0,
                           progress: OnProgress | None = None) -> tuple[list[LabelledQuery], int]:
    """``written_requests`` by the default instruct model without its adapter (the adapter only names tools), filtered
    by all-MiniLM-L6-v2 retrieval; ``progress`` told the requests written so far."""
    from transformers import AutoTokenizer

    from tooltrie.ranker import Ranker
    from tooltrie.serve.model import load_model

    model, info = load_model(None, adapter=False)
    generate = hf_generate(model, AutoTokenizer.from_pretrained(info.path), seed=seed, progress=progress)
    return written_requests(registry, generate, Ranker(registry).similarities, per_tool=per_tool, seed=seed)


__all__ = ["SHOTS", "default_model_requests", "first_lines", "hf_generate", "prompt_for", "written_requests"]
