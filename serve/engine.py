"""The decoding engine: batched greedy answers of exactly k tools from a causal LM, constrained by an artifact.

What makes it cheaper than decoding without the constraint:

- **prefix cache**: the prompt's shared part (chat template, system prompt with the catalog) is run through the
  model once per engine; every request starts from a copy of its keys and values;
- **sparse head**: at a decision point only the output-embedding rows of the legal tokens are multiplied
  (``hidden @ W[legal].T``), never the full ``[B, V]`` logits;
- **forced chains**: where the trie leaves one legal token, it is taken without asking the model, and the whole
  run is fed in the next forward pass, so forward passes per answer = decision points.

Slots join and leave between steps (continuous batching): a finished answer's row is dropped from the key/value
cache, and a waiting request is prefilled and merged in. Choices follow the trie decoder's rule (argmax over legal
tokens, ties to the lower id), through ``kernels/rules.py``, so the engine picks what the reference decoder picks
on the full head's logits. Rows without a grammar (``constrained=False``) decode plainly with the full head.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tooltrie.compiler.artifact import Artifact
from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR, TokenizerInfo
from tooltrie.errors import DecodeError
from tooltrie.kernels.rules import Move, Slot, advance, legal_moves
from tooltrie.kernels.state import check_k

DEFAULT_CHAT_TEMPLATE = BUNDLED_TOKENIZERS_DIR / "smollm2-135m" / "chat_template.jinja"
SYSTEM_PROMPT = ("You choose the tools that answer the user's request. Reply with the names of the {k} best tools, "
                 "most relevant first, separated by \"{separator}\".\nTools:\n{catalog}")
_QUERY_MARK = "\x00QUERY\x00"


@dataclass(frozen=True)
class Request:
    """One discovery question. ``constrained=False`` decodes without the grammar (plain greedy, full head)."""

    query: str
    k: int
    constrained: bool = True
    max_new_tokens: int = 64  # for unconstrained requests, and for a reasoning model's thinking
    reasoning: bool = False  # let a reasoning model think first: the constraint starts after its end marker


@dataclass
class ToolChoice:
    rank: int
    name: str
    pointer: str
    score: float  # log-probability of choosing this tool, under the constraint, given the ones before it
    margin: float  # smallest logit lead of the chosen token over the runner-up at this tool's decision points


@dataclass
class Answer:
    tools: list[ToolChoice]
    finish_reason: str  # "stop" | "length" | "error"
    token_ids: list[int]
    text: str
    forward_passes: int
    decision_points: int
    prompt_tokens: int
    latency_ms: float


@dataclass
class _Row:
    """A request being decoded: its slot in the trie, what to feed next, and its running totals."""

    request: Request
    slot: Slot | None  # None: no grammar
    pending: list[int]  # tokens chosen but not yet fed to the model
    started: float
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    forward_passes: int = 0
    decision_points: int = 0
    scores: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # tool index -> (logprob, margin)
    finish_reason: str | None = None
    hidden: torch.Tensor | None = None  # the last hidden state, fresh after each forward pass
    thinking: bool = False  # still before the reasoning-end marker


class Engine:
    """Answers discovery requests with ``model`` under ``artifact``'s grammar.

    ``model`` is a Hugging Face causal LM whose logits are ``lm_head(last hidden state)`` (Llama-style), with the
    tokenizer the artifact was compiled for.
    """

    def __init__(self, model: Any, tokenizer: TokenizerInfo, artifact: Artifact, *, max_batch: int = 16,
                 chat_template: str | Path | None = None, system_prompt: str | None = None) -> None:
        artifact.check_compatible(tokenizer=tokenizer, where="engine")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.reasoning_end_id = tokenizer.reasoning_end_id
        self.model, self.tokenizer, self.artifact, self.max_batch = model.eval(), tokenizer, artifact, max_batch
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings().weight.detach()
        if self.head.shape[0] <= artifact.max_token_id:
            raise ValueError(f"the model's head has {self.head.shape[0]} rows; the grammar needs token "
                             f"{artifact.max_token_id}")
        template = Path(chat_template or DEFAULT_CHAT_TEMPLATE).read_text(encoding="utf-8")
        self._system = system_prompt if system_prompt is not None else SYSTEM_PROMPT
        self._template = template
        self._prefix: dict[int, tuple[str, list[int], Any, str]] = {}  # k -> (text, ids, key/value cache, suffix)

    # -- prompt and prefix cache ------------------------------------------------------------------------------

    def prompt_parts(self, k: int) -> tuple[str, str]:
        """The prompt around the query: (shared prefix, suffix template with ``{query}``)."""
        import jinja2

        catalog = "\n".join(f"{t.name}: {t.description}" for t in self.artifact.registry.tools)
        system = self._system.format(k=k, separator=self.artifact.contract.separator, catalog=catalog)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": _QUERY_MARK}]
        text = jinja2.Environment(autoescape=False).from_string(self._template).render(
            messages=messages, add_generation_prompt=True)
        prefix, suffix = text.split(_QUERY_MARK)
        return prefix, suffix

    def _prefix_cache(self, k: int) -> tuple[str, list[int], Any, str]:
        if k not in self._prefix:
            prefix_text, suffix = self.prompt_parts(k)
            ids = self.tokenizer.encode(prefix_text)
            with torch.inference_mode():
                out = self.decoder(input_ids=torch.tensor([ids]), use_cache=True)
            self._prefix[k] = (prefix_text, ids, out.past_key_values, suffix)
        return self._prefix[k]

    # -- the loop ---------------------------------------------------------------------------------------------

    def answer(self, query: str, k: int) -> Answer:
        return self.run([Request(query, k)])[0]

    def run(self, requests: Sequence[Request]) -> list[Answer]:
        """Answer every request, up to ``max_batch`` at a time; answers come back in request order."""
        for i, request in enumerate(requests):
            if request.constrained:
                check_k(request.k, self.artifact.trie.n_tools, where=f"request {i}")
            if request.reasoning and self.reasoning_end_id is None:
                raise DecodeError(f"request {i}: reasoning asked for, but {self.tokenizer.source} has no "
                                  "reasoning-end marker (</think> or the like)")
        waiting = deque(enumerate(requests))
        active: list[tuple[int, _Row]] = []
        batch = _Batch()
        answers: dict[int, Answer] = {}
        with torch.inference_mode():
            while waiting or active:
                admitted: list[tuple[int, _Row, list[int], int]] = []
                while waiting and len(active) + len(admitted) < self.max_batch:
                    index, request = waiting.popleft()
                    row, ids, shared = self._admit(request)
                    if row.finish_reason is not None:  # forced from start to stop: nothing for the model to decide
                        answers[index] = self._finish(row)
                    else:
                        admitted.append((index, row, ids, shared))
                for k in sorted({row.request.k for _, row, _, _ in admitted}):
                    group = [entry for entry in admitted if entry[1].request.k == k]
                    batch.join(*self._prefill(group))
                    for index, row, _, _ in group:
                        active.append((index, row))
                        self._decide(row)
                done = [i for i, (_, row) in enumerate(active) if row.finish_reason is not None]
                for i in done:
                    answers[active[i][0]] = self._finish(active[i][1])
                if done:
                    batch.keep([i for i in range(len(active)) if i not in done])
                    active = [entry for i, entry in enumerate(active) if i not in done]
                if active:
                    self._forward(active, batch)
                    for _, row in active:
                        self._decide(row)
        return [answers[i] for i in range(len(requests))]

    def _admit(self, request: Request) -> tuple[_Row, list[int], int]:
        """A new request's row, its prompt ids, and how many of them the cached prefix covers."""
        prefix_text, prefix_ids, _, suffix = self._prefix_cache(request.k)
        # The prompt is tokenized whole, as the model would see it; the cached prefix serves as far as the two
        # agree (a query starting with a newline can merge with the prefix's last token).
        prompt_ids = self.tokenizer.encode(prefix_text + request.query + suffix)
        slot = Slot.start(self.artifact.trie, request.k) if request.constrained else None
        row = _Row(request=request, slot=slot, pending=[], started=time.perf_counter(),
                   prompt_tokens=len(prompt_ids), thinking=request.reasoning)
        self._take_forced(row)
        return row, prompt_ids, _common_length(prefix_ids, prompt_ids)

    def _prefill(self, group: list[tuple[int, _Row, list[int], int]]) -> tuple[Any, torch.Tensor]:
        """One forward pass over the prompts (after the cached prefix) and forced starts of requests sharing a k;
        returns their key/value cache and attention mask, rows in the group's order."""
        prefix_cache = self._prefix_cache(group[0][1].request.k)[2]
        shared = min(entry[3] for entry in group)
        feeds = [ids[shared:] + row.pending for _, row, ids, _ in group]
        width = max(len(feed) for feed in feeds)
        input_ids = torch.full((len(group), width), self.artifact.eos_id, dtype=torch.long)
        mask = torch.zeros((len(group), shared + width), dtype=torch.long)
        mask[:, :shared] = 1
        for i, feed in enumerate(feeds):
            input_ids[i, : len(feed)] = torch.tensor(feed)
            mask[i, shared : shared + len(feed)] = 1
        cache = _rebuild([(k[:, :, :shared].expand(len(group), -1, -1, -1).contiguous(),
                           v[:, :, :shared].expand(len(group), -1, -1, -1).contiguous())
                          for k, v in _layers(prefix_cache)])
        out = self.decoder(input_ids=input_ids, attention_mask=mask, position_ids=shared + torch.arange(width)[None],
                           past_key_values=cache, use_cache=True)
        for i, (feed, (_, row, _, _)) in enumerate(zip(feeds, group, strict=True)):
            row.hidden = out.last_hidden_state[i, len(feed) - 1]
            row.forward_passes += 1
            row.token_ids += row.pending
            row.pending = []
        return cache, mask

    def _forward(self, active: list[tuple[int, _Row]], batch: _Batch) -> None:
        """One pass over every row's pending tokens (right-padded; padding stays masked out forever)."""
        width = max(len(row.pending) for _, row in active)
        ids = torch.full((len(active), width), self.artifact.eos_id, dtype=torch.long)
        new_mask = torch.zeros((len(active), width), dtype=torch.long)
        for i, (_, row) in enumerate(active):
            ids[i, : len(row.pending)] = torch.tensor(row.pending)
            new_mask[i, : len(row.pending)] = 1
        positions = batch.mask.sum(dim=1, keepdim=True) + torch.arange(width)
        batch.mask = torch.cat([batch.mask, new_mask], dim=1)
        out = self.decoder(input_ids=ids, attention_mask=batch.mask, position_ids=positions,
                           past_key_values=batch.cache, use_cache=True)
        for i, (_, row) in enumerate(active):
            row.hidden = out.last_hidden_state[i, len(row.pending) - 1]
            row.forward_passes += 1
            row.token_ids += row.pending
            row.pending = []

    def _decide(self, row: _Row) -> None:
        """Choose the next token at a decision point from the row's fresh hidden state, then take the forced run."""
        if row.finish_reason is not None:
            return
        hidden = row.hidden
        assert hidden is not None  # every decision follows a forward pass
        if row.thinking:  # a reasoning model thinks freely, but may not stop before its answer
            logits = self.head @ hidden
            logits[self.artifact.eos_id] = float("-inf")
            token = int(torch.argmax(logits))
            row.thinking = token != self.reasoning_end_id
            if len(row.token_ids) + 1 >= row.request.max_new_tokens and row.thinking:
                row.token_ids.append(token)
                row.pending, row.finish_reason = [], "length"
            else:
                row.pending = [token]
                if not row.thinking:
                    self._take_forced(row)
            return
        if row.slot is None:  # no grammar: plain greedy over the full head
            token = int(torch.argmax(self.head @ hidden))
            row.pending = [token]
            if token == self.artifact.eos_id:
                row.token_ids.append(token)
                row.pending, row.finish_reason = [], "stop"
            elif len(row.token_ids) + 1 >= row.request.max_new_tokens:
                row.token_ids.append(token)
                row.pending, row.finish_reason = [], "length"
            return
        moves = legal_moves(self.artifact.trie, row.slot, self.artifact.eos_id)
        if not moves:
            row.finish_reason = "error"
            return
        tokens = sorted(moves)
        logits = (self.head[tokens] @ hidden).double()
        best = int(torch.argmax(logits))  # first maximum: tokens ascend, so ties go to the lower id
        if len(tokens) > 1:
            row.decision_points += 1
            runner_up = torch.topk(logits, 2).values[1]
            logprob = float(logits[best] - torch.logsumexp(logits, 0))
            # The decision is about the tool still being spelled while it may go on or end here; only when every
            # option starts the next tool (a choice among its first tokens) is it about that one.
            choosing_next = all(move.kind == "hop" for move in moves.values())
            tool_index = row.slot.emitted + (1 if choosing_next else 0)
            row.scores.setdefault(tool_index, []).append((logprob, float(logits[best] - runner_up)))
        self._take(row, moves[tokens[best]])
        self._take_forced(row)

    def _take(self, row: _Row, move: Move) -> None:
        assert row.slot is not None
        row.slot = advance(self.artifact.trie, row.slot, move)
        if move.kind == "stop":
            row.token_ids += [*row.pending, move.token]
            row.pending, row.finish_reason = [], "stop"
        else:
            row.pending.append(move.token)

    def _take_forced(self, row: _Row) -> None:
        """Follow the trie while it leaves a single legal token: no model call needed for those."""
        while row.slot is not None and row.finish_reason is None and not row.thinking:
            moves = legal_moves(self.artifact.trie, row.slot, self.artifact.eos_id)
            if len(moves) != 1:
                return
            self._take(row, next(iter(moves.values())))

    def _finish(self, row: _Row) -> Answer:
        names = self.artifact.registry.names
        tools = []
        if row.slot is not None and row.finish_reason == "stop":
            for rank, tool in enumerate(row.slot.used):
                decisions = row.scores.get(rank, [])
                tools.append(ToolChoice(
                    rank=rank + 1, name=names[tool], pointer=self.artifact.registry.tools[tool].pointer,
                    score=sum(lp for lp, _ in decisions), margin=min((m for _, m in decisions), default=float("inf"))))
        ids = [t for t in row.token_ids if t != self.artifact.eos_id]
        if row.request.reasoning and self.reasoning_end_id in ids:  # the answer is what follows the thinking
            ids = ids[ids.index(self.reasoning_end_id) + 1 :]
        return Answer(tools=tools, finish_reason=row.finish_reason or "error", token_ids=row.token_ids,
                      text=self.tokenizer.decode(ids), forward_passes=row.forward_passes,
                      decision_points=row.decision_points, prompt_tokens=row.prompt_tokens,
                      latency_ms=(time.perf_counter() - row.started) * 1e3)


def response(answer: Answer, artifact: Artifact) -> dict[str, Any]:
    """The discovery endpoint's JSON object for an answer (also what ``tooltrie ask --json`` prints)."""
    return {
        "tools": [{"rank": t.rank, "name": t.name, "pointer": t.pointer, "score": round(t.score, 4)}
                  for t in answer.tools],
        "finish_reason": answer.finish_reason,
        "registry": artifact.registry.name,
        "usage": {"prompt_tokens": answer.prompt_tokens, "completion_tokens": len(answer.token_ids),
                  "forward_passes": answer.forward_passes, "decision_points": answer.decision_points},
        "latency_ms": round(answer.latency_ms, 2),
    }


class _Batch:
    """The active rows' key/value cache and attention mask, rows in the engine's order."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)

    def join(self, cache: Any, mask: torch.Tensor) -> None:
        if self.cache is None or self.mask.shape[0] == 0:
            self.cache, self.mask = cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self.cache = _concat_caches(_pad_cache(self.cache, width), _pad_cache(cache, width))
        self.mask = torch.cat([_pad_mask(self.mask, width), _pad_mask(mask, width)])

    def keep(self, rows: list[int]) -> None:
        """Compact after evictions: keep these rows, in this order."""
        if not rows:
            self.cache, self.mask = None, torch.zeros((0, 0), dtype=torch.long)
            return
        index = torch.tensor(rows)
        self.cache = _select_cache(self.cache, index)
        self.mask = self.mask[index]


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _rebuild(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    return DynamicCache(pairs)


def _pad_cache(cache: Any, width: int) -> Any:
    if all(keys.shape[2] == width for keys, _ in _layers(cache)):
        return cache
    pairs = []
    for keys, values in _layers(cache):
        missing = width - keys.shape[2]
        pairs.append((torch.nn.functional.pad(keys, (0, 0, 0, missing)),
                      torch.nn.functional.pad(values, (0, 0, 0, missing))))
    return _rebuild(pairs)


def _concat_caches(a: Any, b: Any) -> Any:
    return _rebuild([(torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(
        _layers(a), _layers(b), strict=True)])


def _select_cache(cache: Any, index: torch.Tensor) -> Any:
    return _rebuild([(k[index], v[index]) for k, v in _layers(cache)])


def _common_length(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    return mask if mask.shape[1] == width else torch.nn.functional.pad(mask, (0, width - mask.shape[1]))


__all__ = ["Answer", "Engine", "Request", "ToolChoice", "response"]
