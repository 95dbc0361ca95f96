"""The decoding engine: batched greedy answers of exactly k tools from a causal LM, constrained by an artifact.

What makes it cheaper than decoding without the constraint:

- **prefix cache**: the prompt's shared part (chat template, system prompt with the catalog) is run through the
  model once per engine; every request starts from a copy of its keys and values;
- **sparse head**: at a decision point only the output-embedding rows of the legal tokens are multiplied
  (``hidden @ W[legal].T``), never the full ``[B, V]`` logits;
- **forced chains**: where the trie leaves one legal token, it is taken without asking the model, and the whole
  run is fed in the next forward pass, so forward passes per answer <= decision points;
- **speculated runs**: where a name's first token may be followed by more than one (Research|Finder,
  Research|Helper), the runs up to that next choice ride on the same pass as the row, each seeing the row and itself
  (``SharedPrefixDecoder.forward``'s runs); the taken one's hidden state decides the next choice without a pass of
  its own. So a pass decides a whole name (a k = 1 answer on the catalog is one pass; in float32, only the prompt's
  pass carries runs, see ``_run``); ``speculate`` bounds the extra tokens per row and pass.

The trie state is one persistent batch state (``kernels/batch.py``), a row per cache slot, advanced by a backend
(``Engine(..., backend=...)``, chosen by the model's device unless named): ``"cpu"`` (the Numba walk) or ``"cuda"``
(the fused kernels, on the model's GPU), or ``"reference"`` (the readable oracle, for tests). At a decision point
one ``choose_sparse`` call for every deciding row computes the legal tokens' dot products, the choice, the numbers
its score needs (best, runner-up, log-sum-exp, how many tokens were legal) and the forced run after it; the engine
only routes tokens. Rows thinking (a reasoning model before its end marker) take the full head in torch, and hand
their token to the state with ``accept``.

Slots join and leave between steps (continuous batching): a finished answer's row is dropped from the key/value
cache, and a waiting request is prefilled and merged in. Choices follow the trie decoder's rule (argmax over legal
tokens, ties to the lower id), so the engine picks what the reference decoder picks on the full head's logits.
Rows without a grammar (``constrained=False``) decode plainly with the full head.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tooltrie.compiler.artifact import Artifact
from tooltrie.compiler.tokenizer_info import TokenizerInfo
from tooltrie.errors import DecodeError
from tooltrie.kernels.batch import TrieBatch
from tooltrie.kernels.state import DONE, ERROR, check_k, check_subset
from tooltrie.ranker import MODEL_ONLY, Prior, Ranker, RankerError, check_ranker
from tooltrie.registry.subsets import select_tools
from tooltrie.serve.adapter import AdapterRecord, low_rank_updates
from tooltrie.serve.decoder import Prefix, SharedPrefixDecoder
from tooltrie.serve.prompt import Prompt

_RUNS_CACHED = 4096  # decision points whose speculated runs an engine keeps (the catalog's k = 1 answers need one)


@dataclass(frozen=True)
class Request:
    """One discovery question. ``constrained=False`` decodes without the grammar (plain greedy, full head)."""

    query: str
    k: int
    constrained: bool = True
    max_new_tokens: int = 64  # for unconstrained requests, and for a reasoning model's thinking
    reasoning: bool = False  # let a reasoning model think first: the constraint starts after its end marker
    allow: tuple[str, ...] | None = None  # tool names or tags the answer may use (None: every tool)
    deny: tuple[str, ...] = ()  # tool names or tags it may not use
    ranker: str = "model"  # what the choices rank by: model, retrieval or fused (``tooltrie/ranker.py``)
    # The ranker's prior for this request, made when it was admitted (``Ranker.row``); None: made at ``submit``.
    prior: Prior | None = field(default=None, compare=False, repr=False)


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
    decision_points: int  # = forward_passes + speculated for a constrained answer
    prompt_tokens: int
    latency_ms: float
    speculated: int = 0  # decisions taken on a speculated run's hidden state, without a pass of their own
    ranker: dict[str, float] = field(default_factory=MODEL_ONLY.as_dict)  # the weights its choices used


@dataclass
class _Row:
    """A request being decoded: what to feed next, and its running totals (its trie state is its cache slot's row of
    the engine's batch state)."""

    request: Request
    pending: list[int]  # tokens chosen but not yet fed to the model
    started: float
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    forward_passes: int = 0
    decision_points: int = 0
    scores: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # tool index -> (logprob, margin)
    finish_reason: str | None = None
    hidden: torch.Tensor | None = None  # the last hidden state, fresh after each forward pass
    cache_slot: int = -1  # the row's place in the decoder's key/value cache while it is in the batch
    thinking: bool = False  # still before the reasoning-end marker
    runs: list[tuple[int, ...]] = field(default_factory=list)  # speculated runs fed after the row in the last pass
    run_hidden: list[torch.Tensor] = field(default_factory=list)  # their last hidden states
    speculated: int = 0
    ranker: dict[str, float] = field(default_factory=MODEL_ONLY.as_dict)  # the weights its choices use


class Engine:
    """Answers discovery requests with ``model`` under ``artifact``'s grammar.

    ``model`` is a Hugging Face causal LM whose logits are ``lm_head(last hidden state)`` (Llama-style), with the
    tokenizer the artifact was compiled for. ``ranker`` gives the retrieval prior that requests asking for the
    ``retrieval`` or ``fused`` ranker need. ``adapter``: a LoRA adapter for this registry, trained on ``model`` as
    it is (not merged into it: engines for other registries share the model's weights).
    """

    def __init__(self, model: Any, tokenizer: TokenizerInfo, artifact: Artifact, *, max_batch: int = 16,
                 prompt: Prompt | None = None, backend: str | None = None, speculate: int = 16,
                 ranker: Ranker | None = None, adapter: AdapterRecord | None = None) -> None:
        artifact.check_compatible(tokenizer=tokenizer, where="engine")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if speculate < 0:
            raise ValueError(f"speculate must be at least 0, got {speculate}")
        self.speculate = speculate  # most speculated tokens per row and pass (0: none)
        self.ranker = ranker
        self._runs_after: dict[bytes, list[tuple[int, ...]]] = {}  # a decision point -> the runs worth speculating
        self.reasoning_end_id = tokenizer.reasoning_end_id
        self.model, self.tokenizer, self.artifact, self.max_batch = model.eval(), tokenizer, artifact, max_batch
        self.adapter = adapter  # a LoRA adapter added in each pass, the model's weights left as they are
        self.decoder = SharedPrefixDecoder(model, max_batch, adapter=None if adapter is None else
                                           low_rank_updates(model, adapter))
        self.head = model.get_output_embeddings().weight.detach()
        self._runs_every_pass = self.head.dtype != torch.float32  # see ``_run``
        if self.head.shape[0] <= artifact.max_token_id:
            raise ValueError(f"the model's head has {self.head.shape[0]} rows; the grammar needs token "
                             f"{artifact.max_token_id}")
        self.backend = backend or ("cuda" if self.head.is_cuda else "cpu")
        self.batch = TrieBatch(artifact, backend=self.backend, capacity=max_batch,
                               reasoning_end_id=self.reasoning_end_id)
        self._head = _decision_head(self.head, self.backend)  # what the backend multiplies, made once
        self.prompt = prompt or Prompt()
        self._prompts: dict[int, tuple[str, str]] = {}  # k -> (prefix text, suffix)
        self._prefixes: dict[str, Prefix] = {}  # prefix text -> its keys and values, computed once
        self._waiting: deque[tuple[int, Request, frozenset[int] | None, Prior | None]] = deque()
        self._active: list[tuple[int, _Row]] = []  # (ticket, row)
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._next_ticket = 0

    # -- prompt and prefix cache ------------------------------------------------------------------------------

    def prompt_parts(self, k: int) -> tuple[str, str]:
        """The prompt around the query: (shared prefix, suffix)."""
        return self.prompt.parts(self.artifact.registry, self.artifact.contract, k)

    def _prefix(self, k: int) -> tuple[str, Prefix, str]:
        """(prefix text, its cached keys and values, suffix) for answers of ``k`` tools."""
        if k not in self._prompts:
            self._prompts[k] = self.prompt_parts(k)
        text, suffix = self._prompts[k]
        if text not in self._prefixes:
            ids = self.tokenizer.encode(text)
            context = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
            if context is not None and len(ids) >= context:  # e.g. a large registry listed in a catalog prompt
                listed = " (it lists every tool: use the short prompt style)" if "{catalog}" in self.prompt.system \
                    else ""
                raise DecodeError(f"the prompt for registry {self.artifact.registry.name!r} takes {len(ids):,} "
                                  f"tokens and the model reads at most {context:,}{listed}")
            with torch.inference_mode():
                self._prefixes[text] = self.decoder.prefix(ids)
        return text, self._prefixes[text], suffix

    # -- the loop ---------------------------------------------------------------------------------------------

    def answer(self, query: str, k: int) -> Answer:
        return self.run([Request(query, k)])[0]

    def run(self, requests: Sequence[Request]) -> list[Answer]:
        """Answer every request, up to ``max_batch`` at a time; answers come back in request order. Every request
        is checked before any is started."""
        for i, request in enumerate(requests):
            self._check(request, where=f"request {i}")
        tickets = [self.submit(request) for request in requests]
        answers: dict[int, Answer] = {}
        while self.busy:
            answers.update(self.step())
        return [answers[ticket] for ticket in tickets]

    # -- continuous batching: submit, step, cancel (one thread drives an engine) ---------------------------------

    def fresh(self) -> Engine:
        """An engine like this one (model, artifact, prompt, ranker, adapter, backend, limits) with no rows: what
        serving swaps in when a step failed and this one's state can no longer be trusted."""
        return Engine(self.model, self.tokenizer, self.artifact, max_batch=self.max_batch, prompt=self.prompt,
                      backend=self.backend, speculate=self.speculate, ranker=self.ranker, adapter=self.adapter)

    def submit(self, request: Request) -> int:
        """Queue a request; it joins the running batch at a later ``step``. Returns its ticket. Its prior is made
        here when it comes without one (or with one for another version of the registry), never in a step."""
        allowed = self._check(request, where="request")
        ticket = self._next_ticket
        self._next_ticket += 1
        self._waiting.append((ticket, request, allowed, self._prior(request)))
        return ticket

    def _prior(self, request: Request) -> Prior | None:
        if request.ranker == "model" or self.ranker is None:  # ``_check`` refused a ranker the engine cannot give
            return None
        prior = request.prior
        if prior is None or prior.registry_sha256 != self.artifact.registry.sha256:
            prior = self.ranker.row(request.query, request.ranker)
        return prior

    def cancel(self, ticket: int) -> bool:
        """Drop a request (e.g. its client left): it leaves the queue, or its slot is freed at the next step."""
        for entry in self._waiting:
            if entry[0] == ticket:
                self._waiting.remove(entry)
                return True
        for index, row in self._active:
            if index == ticket and row.finish_reason is None:
                row.finish_reason = "cancelled"
                return True
        return False

    @property
    def busy(self) -> bool:
        """Requests are waiting or being decoded."""
        return bool(self._waiting or self._active)

    @property
    def load(self) -> tuple[int, int]:
        """(active rows, waiting requests)."""
        return len(self._active), len(self._waiting)

    def step(self) -> dict[int, Answer]:
        """Admit waiting requests into free slots, run one forward pass over the batch (the newcomers' prompts and
        the others' next tokens together), and return the answers that finished (by ticket). A request whose
        decoding fails ends with ``finish_reason="error"`` without touching its neighbours."""
        finished: dict[int, Answer] = {}
        with torch.inference_mode():
            self._evict(finished)  # cancelled rows leave before the pass
            prompts = self._admit_waiting(finished)
            if self._active:
                rows = [row for _, row in self._active]
                self._run(rows, [prompts.get(ticket, []) for ticket, _ in self._active])
                self._decide_all(rows)
                self._evict(finished)
        return finished

    def _check(self, request: Request, *, where: str) -> frozenset[int] | None:
        """Refuse a request that cannot be answered; returns the tools it may name (None: all)."""
        allowed = select_tools(self.artifact.registry, request.allow, request.deny, where=where)
        if request.constrained:
            check_k(request.k, self.artifact.trie.n_tools, where=where)
            check_subset(self.artifact, allowed, request.k, where=where)
        check_ranker(request.ranker, where=where)
        if request.ranker != "model" and (self.ranker is None or not request.constrained):
            raise RankerError(f"{where}: the {request.ranker} ranker needs a constrained request and an engine with a "
                              "retrieval ranker (Engine(..., ranker=Ranker(registry)))")
        if request.reasoning and self.reasoning_end_id is None:
            raise DecodeError(f"{where}: reasoning asked for, but {self.tokenizer.source} has no "
                              "reasoning-end marker (</think> or the like)")
        return allowed

    def _admit_waiting(self, finished: dict[int, Answer]) -> dict[int, list[int]]:
        """Waiting requests take free slots and join the batch; returns the prompt tokens (after the cached
        prefix) each admitted ticket feeds in the coming pass. One forced from start to stop is answered here."""
        prompts: dict[int, list[int]] = {}
        while self._waiting and self._free_slots and len(self._active) < self.max_batch:
            ticket, request, allowed, prior = self._waiting.popleft()
            row, feed = self._admit(request, allowed, prior)
            if row.finish_reason is not None:  # nothing for the model to decide
                finished[ticket] = self._finish(row)
            else:
                self._active.append((ticket, row))
                prompts[ticket] = feed
        return prompts

    def _evict(self, finished: dict[int, Answer]) -> None:
        """Finished rows leave the batch and free their cache slot; their answers are handed out (a cancelled
        one is dropped)."""
        still = []
        for ticket, row in self._active:
            if row.finish_reason is None:
                still.append((ticket, row))
                continue
            self.decoder.release(row.cache_slot)
            self._release(row)
            if row.finish_reason != "cancelled":
                finished[ticket] = self._finish(row)
        self._active = still

    def _release(self, row: _Row) -> None:
        if row.request.constrained:
            self.batch.remove(row.cache_slot)
        self._free_slots.append(row.cache_slot)

    def _admit(self, request: Request, allowed: frozenset[int] | None,
               prior: Prior | None) -> tuple[_Row, list[int]]:
        """A new request's row (holding a cache slot, on its prefix) and the tokens to feed it first."""
        prefix_text, prefix, suffix = self._prefix(request.k)
        # The prompt is tokenized whole, as the model would see it; the cached prefix serves as far as the two
        # agree (a query starting with a newline can merge with the prefix's last token).
        prompt_ids = self.tokenizer.encode_prompt(prefix_text, request.query, suffix)  # the query as plain text
        shared = shared_prefix_length(prefix.ids, prompt_ids)
        row = _Row(request=request, pending=[], started=time.perf_counter(), prompt_tokens=len(prompt_ids),
                   thinking=request.reasoning, cache_slot=self._free_slots.pop())
        if request.constrained:
            if prior is not None:
                row.ranker = prior.weights.as_dict()
            self.batch.add(row.cache_slot, request.k, thinking=request.reasoning, subset=allowed,
                           prior=None if prior is None else prior.scores,
                           model_weight=1.0 if prior is None else prior.model_weight)
            if not request.reasoning:
                forced = self.batch.follow_forced([row.cache_slot])[0]
                self.batch.fetch()
                self._take(row, [], forced)
        if row.finish_reason is None:
            self.decoder.start(row.cache_slot, prefix, shared)
        else:  # forced from start to stop: the slot was never used
            self._release(row)
        return row, prompt_ids[shared:]

    def _run(self, rows: list[_Row], prompts: list[list[int]]) -> None:
        """Feed each row its prompt part (if any) and pending tokens, with its speculated runs, in one forward pass.
        In float32 only a row's first pass (its prompt's) carries runs: a few tokens more on some dozens there,
        while on a later pass of a few tokens they cost more than the passes they save; in half precision, where
        the CPU's matrix units make a few more rows nearly free, every pass does (measured, default model, k = 3,
        runs on every pass against the prompt's only: bfloat16 -19 ms per answer, float32 +26 ms)."""
        feeds = [prompt + row.pending for row, prompt in zip(rows, prompts, strict=True)]
        self.batch.fetch()  # the host's copy of the trie state, for the runs (a device backend copies it back)
        for row, prompt in zip(rows, prompts, strict=True):
            row.runs = self._speculated_runs(row) if prompt or self._runs_every_pass else []
        hidden = self.decoder.forward([row.cache_slot for row in rows], feeds, [row.runs for row in rows])
        after = len(rows)
        for i, row in enumerate(rows):
            row.hidden = hidden[i]
            row.run_hidden = list(hidden[after : after + len(row.runs)])
            after += len(row.runs)
            row.forward_passes += 1
            row.token_ids += row.pending
            row.pending = []

    def _speculated_runs(self, row: _Row) -> list[tuple[int, ...]]:
        """The runs from the row's coming decision to the next one within the same name (each legal token, then
        what the trie forces after it), up to ``speculate`` tokens in all: what the pass after this one would be
        fed, if the choice falls on one of them. Cached by the row's state (and its subset)."""
        if not self.speculate or not row.request.constrained or row.thinking:
            return []
        state = self.batch.state
        key = state.table[row.cache_slot].tobytes() + (state.allowed[row.cache_slot].tobytes()
                                                        if state.allowed.shape[0] else b"")
        runs = self._runs_after.get(key)
        if runs is None:
            if len(self._runs_after) >= _RUNS_CACHED:
                self._runs_after.clear()
            runs = self._runs_after[key] = self.batch.runs(row.cache_slot, self.speculate)
        return runs

    def _decide_all(self, rows: list[_Row]) -> None:
        """The rows' next tokens after a forward pass; a row whose tokens then reach the end of one of its
        speculated runs adopts it and decides again on the run's hidden state, no pass needed."""
        while rows:
            self._decide(rows)
            rows = [row for row in rows if self._adopt_run(row)]

    def _adopt_run(self, row: _Row) -> bool:
        """If the row's pending tokens are a run fed in the last pass, they join the row: its next decision is
        made on the run's hidden state."""
        runs, hidden = row.runs, row.run_hidden
        row.runs, row.run_hidden = [], []
        pending = tuple(row.pending)
        if row.finish_reason is not None or pending not in runs:
            return False
        run = runs.index(pending)
        self.decoder.adopt(row.cache_slot, run)
        row.hidden = hidden[run]
        row.token_ids += row.pending
        row.pending = []
        row.speculated += 1
        return True

    def _decide(self, rows: list[_Row]) -> None:
        """One decision for each row: every constrained one in one ``choose_sparse`` call (the choice, its numbers
        and the forced run after it); rows thinking or without a grammar take the full head (``_decide_plain``)."""
        deciding = []
        for row in rows:
            if row.finish_reason is not None:
                continue
            if not row.request.constrained or row.thinking:
                self._decide_plain(row)
            else:
                deciding.append(row)
        if not deciding:
            return
        hidden = torch.stack([row.hidden for row in deciding])  # type: ignore[misc]  # each after a forward pass
        choice = self.batch.choose_sparse(_decision_hidden(hidden, self._head), self._head,
                                          [row.cache_slot for row in deciding])
        self.batch.fetch()  # the rows' statuses, once for the batch (a device backend copies them back)
        for i, row in enumerate(deciding):
            n_legal, _, tool_index = choice.decision[i].tolist()
            if n_legal > 1:
                row.decision_points += 1
                best, runner_up, log_total = choice.stats[i].tolist()
                # The decision is about the tool still being spelled while it may go on or end here; only when every
                # option starts the next tool (a choice among its first tokens) is it about that one.
                row.scores.setdefault(tool_index, []).append((best - log_total, best - runner_up))
            self._take(row, [int(choice.chosen[i])], choice.forced[i])

    def _decide_plain(self, row: _Row) -> None:
        """A row thinking or without a grammar: argmax over the full head."""
        hidden = row.hidden
        assert hidden is not None  # every decision follows a forward pass
        if row.thinking:  # a reasoning model thinks freely (the batch state keeps it from stopping before its answer)
            logits = (self.head @ hidden).float()[None]
            choice = self.batch.choose(logits if logits.is_cuda else logits.numpy(), [row.cache_slot])
            self.batch.fetch()
            token = int(choice.chosen[0])
            row.thinking = token != self.reasoning_end_id
            if len(row.token_ids) + 1 >= row.request.max_new_tokens and row.thinking:
                row.token_ids.append(token)
                row.pending, row.finish_reason = [], "length"
                return
            self._take(row, [token], choice.forced[0])
            return
        # no grammar: plain greedy over the full head
        token = int(torch.argmax(self.head @ hidden))
        row.pending = [token]
        if token == self.artifact.eos_id:
            row.token_ids.append(token)
            row.pending, row.finish_reason = [], "stop"
        elif len(row.token_ids) + 1 >= row.request.max_new_tokens:
            row.token_ids.append(token)
            row.pending, row.finish_reason = [], "length"

    def _take(self, row: _Row, chosen: list[int], forced: list[int]) -> None:
        """The row's chosen token (if any) and the run the trie forced after it join what it feeds next; the trie
        state says whether the answer is complete or failed."""
        if chosen and chosen[0] < 0:  # nothing was legal: fail loudly
            row.finish_reason = "error"
            return
        row.pending += chosen + forced
        status = self.batch.state.status[row.cache_slot]  # fetched by the caller after the batch's call
        if status == DONE:
            row.token_ids += row.pending
            row.pending, row.finish_reason = [], "stop"
        elif status == ERROR:
            row.finish_reason = "error"

    def _finish(self, row: _Row) -> Answer:
        names = self.artifact.registry.names
        tools = []
        if row.request.constrained and row.finish_reason == "stop":
            for rank, tool in enumerate(self.batch.state.tools(row.cache_slot)):  # fetched when its status was read
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
                      latency_ms=(time.perf_counter() - row.started) * 1e3, speculated=row.speculated,
                      ranker=row.ranker)


def _decision_head(head: torch.Tensor, backend: str) -> Any:
    """The output embedding as the backend multiplies it: on a GPU a float32 CUDA tensor (Numba has no bfloat16);
    on the CPU a NumPy view of a float32 head (half precision converted once, exactly)."""
    if head.is_cuda and backend == "cuda":
        return head.float().contiguous() if head.dtype == torch.bfloat16 else head.contiguous()
    from tooltrie.kernels.cpu import as_numpy_scores

    return as_numpy_scores(head)


def _decision_hidden(hidden: torch.Tensor, head: Any) -> torch.Tensor:
    """The hidden states as the backend multiplies them by ``head`` (``_decision_head``'s): where the head is a
    tensor (the CUDA kernels), on its device in its dtype; where it is a NumPy array (the CPU walks, also for a model
    on a GPU), float32 on the CPU."""
    if isinstance(head, torch.Tensor):
        return hidden.to(device=head.device, dtype=head.dtype)
    return hidden.float().cpu()


def response(answer: Answer, artifact: Artifact) -> dict[str, Any]:
    """The discovery endpoint's JSON object for an answer (also what ``tooltrie ask --json`` prints)."""
    return {
        "tools": [{"rank": t.rank, "name": t.name, "pointer": t.pointer, "score": round(t.score, 4)}
                  for t in answer.tools],
        "finish_reason": answer.finish_reason,
        "registry": artifact.registry.name,
        "registry_sha256": artifact.registry.sha256,
        "usage": {"prompt_tokens": answer.prompt_tokens, "completion_tokens": len(answer.token_ids),
                  "forward_passes": answer.forward_passes, "decision_points": answer.decision_points,
                  "speculated": answer.speculated},
        "ranker": answer.ranker,
        "latency_ms": round(answer.latency_ms, 2),
    }


def shared_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (how much of a cached prefix serves a prompt)."""
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


__all__ = ["Answer", "Engine", "Request", "ToolChoice", "response"]
