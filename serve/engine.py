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
only routes tokens. Rows thinking (a reasoning model before its end marker) and rows without a grammar
(``constrained=False``) take the full head, in one product for all of them; a thinking row chooses through the
state (``choose``), which sees its end marker. The trie state is read from the batch state only: a row here holds
what is the engine's (tokens to feed, scores, an end the engine gives), never a copy of a status.

Slots join and leave between steps (continuous batching): a finished answer's row is dropped from the key/value
cache, and a waiting request is merged in, its prompt read ``prefill`` tokens a pass, so a long query is read in chunks
beside the others' steps and never holds the batch for more than one slice; a cancelled row leaves before the next
pass. Choices follow the trie decoder's rule (argmax over legal tokens, ties to
the lower id), so the engine picks what the reference decoder picks on the full head's logits.
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
from tooltrie.kernels.state import DONE, ERROR
from tooltrie.ranker import MODEL_ONLY, Ranker, RankerError
from tooltrie.serve.adapter import AdapterRecord, low_rank_updates
from tooltrie.serve.decoder import Prefix, SharedPrefixDecoder
from tooltrie.serve.limits import ServeLimits
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.request import Answer, Request, RequestStatus, ToolChoice, check_request, request_prior

_RUNS_CACHED = 4096  # decision points whose speculated runs an engine keeps (the catalog's k = 1 answers need one)
# Prompt tokens (after the cached prefix) a row reads per pass: serving's default, whose limits say why.
PREFILL_TOKENS = ServeLimits.prefill_tokens


@dataclass
class _Row:
    """The engine's bookkeeping for a request it is decoding (the request itself carries what was asked and, at the
    end, its answer): what to feed next, and its running totals. Its trie state (node, tools, status, thinking) is its
    cache slot's row of the engine's batch state, read there, never copied; its keys and values are the decoder's, in
    the same slot."""

    request: Request
    prompt: list[int]  # prompt tokens not yet fed (after the cached prefix): fed in chunks, ``Engine.prefill`` a step
    pending: list[int]  # tokens chosen but not yet fed to the model (after the prompt)
    started: float
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    forward_passes: int = 0
    decision_points: int = 0
    scores: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # tool index -> (logprob, margin)
    ended: str | None = None  # an end the engine gives: "length", "cancelled"; "stop"/"error" where no trie says so
    hidden: torch.Tensor | None = None  # the last hidden state, fresh after each forward pass
    cache_slot: int = -1  # the row's place in the decoder's key/value cache while it is in the batch
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
                 ranker: Ranker | None = None, adapter: AdapterRecord | None = None,
                 prefill: int = PREFILL_TOKENS) -> None:
        artifact.check_compatible(tokenizer=tokenizer, where="engine")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if speculate < 0:
            raise ValueError(f"speculate must be at least 0, got {speculate}")
        if prefill < 1:
            raise ValueError(f"prefill must be at least 1, got {prefill}")
        self.speculate = speculate  # most speculated tokens per row and pass (0: none)
        self.prefill = prefill  # most prompt tokens a row reads per pass (a long prompt is read in chunks)
        self.last_prefill = 0  # the most prompt tokens a row read in the last step's pass
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
        self._waiting: deque[Request] = deque()
        self._active: list[_Row] = []
        self._free_slots = list(range(max_batch - 1, -1, -1))

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
        for request in requests:
            self.submit(request)
        while self.busy:
            self.step()
        return [request.answer for request in requests]  # type: ignore[misc]  # each finished by its step

    # -- continuous batching: submit, step, cancel (one thread drives an engine) ---------------------------------

    def fresh(self) -> Engine:
        """An engine like this one (model, artifact, prompt, ranker, adapter, backend, limits) with no rows: what
        serving swaps in when a step failed and this one's state can no longer be trusted."""
        return Engine(self.model, self.tokenizer, self.artifact, max_batch=self.max_batch, prompt=self.prompt,
                      backend=self.backend, speculate=self.speculate, ranker=self.ranker, adapter=self.adapter,
                      prefill=self.prefill)

    def submit(self, request: Request) -> Request:
        """Queue a request; it joins the running batch at a later ``step``, which finishes it (``request.answer``).
        Its allowed tools are resolved and its prior made here when it comes without them (or with them for another
        version of the registry, or another ranker), never in a step."""
        request.tools = self._check(request, where="request")
        request.tools_of = self.artifact.registry
        request.prior = request_prior(request, self.ranker, self.artifact)
        request.status, request.answer, request.error = RequestStatus.WAITING, None, None
        self._waiting.append(request)
        return request

    def cancel(self, request: Request) -> bool:
        """Drop a request (e.g. its client left): it leaves the queue, or its slot is freed at the next step, before
        the pass (a long prompt's later chunks are never read)."""
        if request in self._waiting:
            self._waiting.remove(request)
            request.status = RequestStatus.CANCELLED
            return True
        for row in self._active:
            if row.request is request and self._finish_reason(row) is None:
                row.ended = "cancelled"
                request.status = RequestStatus.CANCELLED
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

    def step(self) -> list[Request]:
        """Admit waiting requests into free slots, run one forward pass over the batch (the next chunk of each prompt
        still being read, up to ``prefill`` tokens, and the others' next tokens together), and return the requests
        that finished (each with its ``answer``). A request whose decoding fails ends with
        ``finish_reason="error"`` without touching its neighbours."""
        finished: list[Request] = []
        self.last_prefill = 0
        with torch.inference_mode():
            self._evict(finished)  # cancelled rows leave before the pass
            self._admit_waiting(finished)
            if self._active:
                rows = list(self._active)
                self._run(rows)
                self._decide_all([row for row in rows if not row.prompt])  # a row reading its prompt decides later
                self._evict(finished)
        return finished

    def _check(self, request: Request, *, where: str) -> frozenset[int] | None:
        """Refuse a request that cannot be answered; returns the tools it may name (None: all)."""
        allowed = check_request(request, self.artifact, where=where)
        if request.ranked_by != "model" and (self.ranker is None or not request.constrained):
            raise RankerError(f"{where}: the {request.ranked_by} ranker needs a constrained request and an engine with "
                              "a retrieval ranker (Engine(..., ranker=Ranker(registry)))")
        if request.reasoning and self.reasoning_end_id is None:
            raise DecodeError(f"{where}: reasoning asked for, but {self.tokenizer.source} has no "
                              "reasoning-end marker (</think> or the like)")
        return allowed

    def _admit_waiting(self, finished: list[Request]) -> None:
        """Waiting requests take free slots and join the batch. One forced from start to stop is answered here."""
        while self._waiting and self._free_slots and len(self._active) < self.max_batch:
            request = self._waiting.popleft()
            request.status = RequestStatus.DECODING
            row = self._admit(request)
            if self._finish_reason(row) is not None:  # nothing for the model to decide: the slot was never used
                finished.append(self._finish(row))
                self._release(row)
            else:
                self._active.append(row)

    def _evict(self, finished: list[Request]) -> None:
        """Finished rows leave the batch and free their cache slot; their requests are finished and handed out (a
        cancelled one is dropped)."""
        still = []
        for row in self._active:
            reason = self._finish_reason(row)
            if reason is None:
                still.append(row)
                continue
            if reason != "cancelled":
                finished.append(self._finish(row))  # before the slot's trie state is freed
            self.decoder.release(row.cache_slot)
            self._release(row)
        self._active = still

    def _finish_reason(self, row: _Row) -> str | None:
        """Why the row's answer is over (None: it goes on): the engine's own reason, else its trie state's (the
        host copy, fetched after the batch's last call)."""
        if row.ended is not None or not row.request.constrained:
            return row.ended
        status = self.batch.state.status[row.cache_slot]
        return "stop" if status == DONE else "error" if status == ERROR else None

    def _thinking(self, row: _Row) -> bool:
        """A reasoning model still before its end marker (its trie state says so; a row without a grammar has none
        and decodes freely)."""
        return row.request.constrained and bool(self.batch.state.thinking[row.cache_slot])

    def _release(self, row: _Row) -> None:
        if row.request.constrained:
            self.batch.remove(row.cache_slot)
        self._free_slots.append(row.cache_slot)

    def _admit(self, request: Request) -> _Row:
        """A new request's row, holding a cache slot, on its prefix, with the rest of its prompt to feed."""
        prefix_text, prefix, suffix = self._prefix(request.k)
        # The prompt is tokenized whole, as the model would see it; the cached prefix serves as far as the two
        # agree (a query starting with a newline can merge with the prefix's last token).
        prompt_ids = self.tokenizer.encode_prompt(prefix_text, request.query, suffix)  # the query as plain text
        shared = shared_prefix_length(prefix.ids, prompt_ids)
        row = _Row(request=request, prompt=prompt_ids[shared:], pending=[], started=time.perf_counter(),
                   prompt_tokens=len(prompt_ids), cache_slot=self._free_slots.pop())
        if request.constrained:
            prior = request.prior
            if prior is not None:
                row.ranker = prior.weights.as_dict()
            self.batch.add(row.cache_slot, request.k, thinking=request.reasoning, subset=request.tools,
                           prior=None if prior is None else prior.scores,
                           model_weight=1.0 if prior is None else prior.model_weight,
                           follow=None if prior is None or prior.scores is None else prior.follow)
            if not request.reasoning:
                forced = self.batch.follow_forced([row.cache_slot])[0]
                self.batch.fetch()
                self._take(row, [], forced)
        self.decoder.start(row.cache_slot, prefix, shared)
        return row

    def _run(self, rows: list[_Row]) -> None:
        """Feed each row its prompt's next chunk (``prefill`` tokens at most) and, once its prompt is all read, its
        pending tokens, with its speculated runs, in one forward pass. An ordinary query is read in one pass; a long
        one a chunk a pass, beside the others' steps, so it adds at most ``prefill`` tokens to any pass.

        In float32 only a row's first decision (its prompt's last pass) carries runs: a few tokens more on some
        dozens there, while on a later pass of a few tokens they cost more than the passes they save; in half
        precision, where the CPU's matrix units make a few more rows nearly free, every pass does (measured, default
        model, k = 3, runs on every pass against the prompt's only: bfloat16 -19 ms per answer, float32 +26 ms)."""
        self.batch.fetch()  # the host's copy of the trie state, for the runs (a device backend copies it back)
        feeds = []
        for row in rows:
            chunk = row.prompt[: self.prefill]
            del row.prompt[: self.prefill]
            self.last_prefill = max(self.last_prefill, len(chunk))
            if row.prompt:  # more of the prompt to come: nothing chosen is fed yet, nothing is speculated
                feeds.append(chunk)
                row.runs = []
            else:
                feeds.append(chunk + row.pending)
                row.runs = self._speculated_runs(row) if chunk or self._runs_every_pass else []
        hidden = self.decoder.forward([row.cache_slot for row in rows], feeds, [row.runs for row in rows])
        after = len(rows)
        for i, row in enumerate(rows):
            row.hidden = hidden[i]
            row.run_hidden = list(hidden[after : after + len(row.runs)])
            after += len(row.runs)
            row.forward_passes += 1
            if not row.prompt:
                row.token_ids += row.pending
                row.pending = []

    def _speculated_runs(self, row: _Row) -> list[tuple[int, ...]]:
        """The runs from the row's coming decision to the next one within the same name (each legal token, then
        what the trie forces after it), up to ``speculate`` tokens in all: what the pass after this one would be
        fed, if the choice falls on one of them. Cached by the row's state (and its subset)."""
        if not self.speculate or not row.request.constrained or self._thinking(row):
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
        if self._finish_reason(row) is not None or pending not in runs:
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
        and the forced run after it); rows thinking or without a grammar in one full-head product
        (``_decide_full_head``)."""
        deciding: list[_Row] = []
        full_head: list[_Row] = []
        for row in rows:
            if self._finish_reason(row) is not None:
                continue
            (full_head if not row.request.constrained or self._thinking(row) else deciding).append(row)
        if full_head:
            self._decide_full_head(full_head)
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

    def _decide_full_head(self, rows: list[_Row]) -> None:
        """Rows thinking or without a grammar: argmax over the full head, one product for them all. A thinking row
        chooses through its trie state (which keeps it from stopping before its answer, and sees the end marker);
        a row without a grammar takes the plain argmax (ties to the lower id, as ``torch.argmax``)."""
        hidden = torch.stack([row.hidden for row in rows])  # type: ignore[misc]  # each after a forward pass
        logits = (hidden.to(self.head.dtype) @ self.head.T).float()
        thinking = [i for i, row in enumerate(rows) if row.request.constrained]
        if thinking:
            scores = logits[thinking]
            choice = self.batch.choose(scores if scores.is_cuda else scores.numpy(),
                                       [rows[i].cache_slot for i in thinking])
            self.batch.fetch()
            for j, (i, forced) in enumerate(zip(thinking, choice.forced, strict=True)):
                row, token = rows[i], int(choice.chosen[j])
                if len(row.token_ids) + 1 >= row.request.max_new_tokens and self._thinking(row):
                    row.token_ids.append(token)
                    row.pending, row.ended = [], "length"
                else:
                    self._take(row, [token], forced)
        plain = [i for i, row in enumerate(rows) if not row.request.constrained]
        for i, token in zip(plain, logits[plain].argmax(dim=1).tolist() if plain else [], strict=True):
            row = rows[i]
            row.pending = [token]
            if token == self.artifact.eos_id or len(row.token_ids) + 1 >= row.request.max_new_tokens:
                row.token_ids.append(token)
                row.pending, row.ended = [], "stop" if token == self.artifact.eos_id else "length"

    def _take(self, row: _Row, chosen: list[int], forced: list[int]) -> None:
        """The row's chosen token (if any) and the run the trie forced after it join what it feeds next; the trie
        state says whether the answer is complete or failed (``_finish_reason``)."""
        if chosen and chosen[0] < 0:  # nothing was legal: fail loudly (the trie state says error; nothing more is fed)
            if self._finish_reason(row) is None:
                row.ended = "error"
            return
        row.pending += chosen + forced
        if self._finish_reason(row) == "stop":
            row.token_ids += row.pending
            row.pending = []

    def _finish(self, row: _Row) -> Request:
        """The row's request, finished with its answer."""
        row.request.finish(self._answer(row))
        return row.request

    def _answer(self, row: _Row) -> Answer:
        names = self.artifact.registry.names
        tools = []
        reason = self._finish_reason(row) or "error"
        if row.request.constrained and reason == "stop":
            for rank, tool in enumerate(self.batch.state.tools(row.cache_slot)):  # fetched when its status was read
                decisions = row.scores.get(rank, [])
                tools.append(ToolChoice(
                    rank=rank + 1, name=names[tool], pointer=self.artifact.registry.tools[tool].pointer,
                    score=sum(lp for lp, _ in decisions), margin=min((m for _, m in decisions), default=float("inf"))))
        ids = [t for t in row.token_ids if t != self.artifact.eos_id]
        if row.request.reasoning and self.reasoning_end_id in ids:  # the answer is what follows the thinking
            ids = ids[ids.index(self.reasoning_end_id) + 1 :]
        return Answer(tools=tools, finish_reason=reason, token_ids=row.token_ids,
                      text=self.tokenizer.decode(ids), forward_passes=row.forward_passes,
                      decision_points=row.decision_points, prompt_tokens=row.prompt_tokens,
                      latency_ms=(time.perf_counter() - row.started) * 1e3, speculated=row.speculated,
                      ranker=row.ranker, artifact=self.artifact)


def _decision_head(head: torch.Tensor, backend: str) -> Any:
    """The output embedding as the backend multiplies it: on a GPU a float32 CUDA tensor (Numba has no bfloat16);
    on the CPU a NumPy view of the head, a bfloat16 one as its bits (widened exactly as it is read: no float32 copy,
    113 MB for SmolLM2-135M)."""
    if head.is_cuda and backend == "cuda":
        return head.float().contiguous() if head.dtype == torch.bfloat16 else head.contiguous()
    from tooltrie.kernels.cpu import as_numpy_head, as_numpy_scores

    return as_numpy_scores(head) if backend == "cuda" else as_numpy_head(head)  # the CUDA kernels: no bfloat16 bits


def _decision_hidden(hidden: torch.Tensor, head: Any) -> torch.Tensor:
    """The hidden states as the backend multiplies them by ``head`` (``_decision_head``'s): where the head is a
    tensor (the CUDA kernels), on its device in its dtype; where it is a NumPy array (the CPU walks, also for a model
    on a GPU), float32 on the CPU."""
    if isinstance(head, torch.Tensor):
        return hidden.to(device=head.device, dtype=head.dtype)
    return hidden.float().cpu()


def shared_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (how much of a cached prefix serves a prompt)."""
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


__all__ = ["Answer", "Engine", "Request", "ToolChoice"]
