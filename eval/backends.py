"""The evaluation arms that run on a CPU: one class each, all answering a batch of queries that share a k.

- ``engine``: tooltrie's own engine (prefix cache, sparse head, forced chains), constrained by the artifact;
- ``unconstrained``: the same engine with ``constrained=False`` (plain greedy over the full head);
- ``hf``: transformers ``generate`` with ``TrieLogitsProcessor``, the drop-in for any HF pipeline;
- ``xgrammar``: transformers ``generate`` with XGrammar's logits processor over the artifact's exactly-k EBNF
  (``compiler/ebnf.py``), the very grammar vLLM's structured outputs would get: it cannot forbid repeats.

Every arm feeds the model the same prompt (``serve.prompt.Prompt``, tokenized whole) and is read back as text, which
the harness scores through the contract's ``parse``. The vLLM arms are in ``vllm_backend.py``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tooltrie.compiler.artifact import Artifact
from tooltrie.compiler.ebnf import exactly_k_ebnf
from tooltrie.compiler.tokenizer_info import TokenizerInfo
from tooltrie.eval.datasets import LabelledQuery
from tooltrie.serve.engine import shared_prefix_length
from tooltrie.serve.prompt import Prompt


@dataclass
class Prediction:
    """One arm's answer to one query, as the harness scores it."""

    text: str  # the answer's text without the stop token: what ``Contract.parse`` reads
    token_ids: list[int]  # the generated tokens (stop token included when it was emitted)
    finish_reason: str  # "stop" | "length" | "error"


@dataclass
class EvalSetup:
    """What every arm shares: the model, its tokenizer, the artifact and the prompt."""

    model: Any
    tokenizer: TokenizerInfo
    artifact: Artifact
    prompt: Prompt
    batch_size: int = 8
    max_new_tokens: int = 48  # for unconstrained decoding (constrained answers end by themselves)
    model_path: Path | None = None  # the model's directory: its tokenizer files go with the copy vLLM loads
    artifact_path: Path | None = None  # for engines that load the artifact themselves (vLLM)
    options: dict[str, Any] = field(default_factory=dict)

    def prompt_ids(self, query: LabelledQuery) -> list[int]:
        """The whole prompt, tokenized in one piece (as the engine does)."""
        registry, contract = self.artifact.registry, self.artifact.contract
        return self.prompt.ids(self.tokenizer, registry, contract, query.query, query.k)

    def answer_budget(self, k: int) -> int:
        """Enough new tokens for any answer of k tools and its stop token, in the trie's canonical tokens."""
        return k * (self.artifact.trie.max_depth + 1) + 1

    def grammar_budget(self, k: int) -> int:
        """Enough for any answer a string-level grammar allows: it may spell a name in any tokenization, down to
        one token per byte."""
        longest = max(len(name.encode("utf-8")) for name in self.artifact.registry.names)
        return k * longest + (k - 1) * len(self.artifact.contract.separator.encode("utf-8")) + 1


class Arm:
    """An evaluation arm: answers a batch of queries that all have the same k."""

    name = ""

    def __init__(self, setup: EvalSetup) -> None:
        self.setup = setup
        self._prefixes: dict[int, tuple[list[int], Any]] = {}

    def predict(self, queries: Sequence[LabelledQuery]) -> list[Prediction]:
        raise NotImplementedError


class EngineArm(Arm):
    """The engine, ranking by ``options["ranker"]`` (model, retrieval or fused; default model), the prior from
    ``options["retrieval"]`` (a ``tooltrie.ranker.Ranker``)."""

    name = "engine"
    constrained = True

    @property
    def ranker(self) -> str:
        return str(self.setup.options.get("ranker", "model"))

    @functools.cached_property
    def engine(self) -> Any:
        from tooltrie.serve.engine import Engine

        s = self.setup
        return Engine(s.model, s.tokenizer, s.artifact, max_batch=s.batch_size, prompt=s.prompt,
                      ranker=s.options.get("retrieval"))

    def predict(self, queries: Sequence[LabelledQuery]) -> list[Prediction]:
        from tooltrie.serve.engine import Request

        requests = [Request(q.query, q.k, constrained=self.constrained, max_new_tokens=self.setup.max_new_tokens,
                            ranker=self.ranker if self.constrained else "model")
                    for q in queries]
        return [Prediction(text=a.text, token_ids=list(a.token_ids), finish_reason=a.finish_reason)
                for a in self.engine.run(requests)]


class UnconstrainedArm(EngineArm):
    name = "unconstrained"
    constrained = False


class FusedArm(EngineArm):
    """The engine with the fused ranker: the model's scores and the retrieval prior, inside the decode."""

    name = "fused"

    @property
    def ranker(self) -> str:
        return "fused"


class GenerateArm(Arm):
    """Greedy ``model.generate`` under a logits processor made per call, one query at a time from a cached prompt
    prefix (transformers' prefix-caching recipe: a copy of the shared prefix's key/value cache per call), so the
    catalog prompt is not recomputed for every query."""

    def processor(self, k: int) -> Any:
        raise NotImplementedError

    def budget(self, k: int) -> int:
        return self.setup.answer_budget(k)

    def predict(self, queries: Sequence[LabelledQuery]) -> list[Prediction]:
        return [self._generate(query) for query in queries]

    def _prefix(self, k: int) -> tuple[list[int], Any]:
        """The shared prompt prefix's ids and key/value cache, computed once per k."""
        if k not in self._prefixes:
            registry, contract = self.setup.artifact.registry, self.setup.artifact.contract
            prefix_ids = self.setup.tokenizer.encode(self.setup.prompt.parts(registry, contract, k)[0])
            with torch.inference_mode():
                cache = self.setup.model(input_ids=self._tensor([prefix_ids]), use_cache=True).past_key_values
            self._prefixes[k] = (prefix_ids, cache)
        return self._prefixes[k]

    def _generate(self, query: LabelledQuery) -> Prediction:
        from transformers import LogitsProcessorList

        ids = self.setup.prompt_ids(query)
        prefix_ids, prefix_cache = self._prefix(query.k)
        # The prompt is tokenized whole; the cached prefix serves as far as the two agree, and at least one prompt
        # token is left for generate to feed.
        shared = min(shared_prefix_length(prefix_ids, ids), len(ids) - 1)
        cache = copy.deepcopy(prefix_cache)
        if shared < len(prefix_ids):
            cache.crop(shared - len(prefix_ids))  # a negative count: drop that many tokens from the end
        eos = self.setup.artifact.eos_id
        with torch.inference_mode():
            out = self.setup.model.generate(
                self._tensor([ids]), attention_mask=self._tensor([[1] * len(ids)]),
                past_key_values=cache, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                max_new_tokens=self.budget(query.k),
                logits_processor=LogitsProcessorList([self.processor(query.k)]))
        return self._prediction(out[0, len(ids):].tolist())

    def _tensor(self, rows: list[list[int]]) -> torch.Tensor:
        """Token ids (or a mask) on the model's device."""
        return torch.tensor(rows, dtype=torch.long, device=self.setup.model.device)

    def _prediction(self, generated: list[int]) -> Prediction:
        eos = self.setup.artifact.eos_id
        if eos in generated:
            tokens = generated[: generated.index(eos) + 1]
            return Prediction(self.setup.tokenizer.decode(tokens[:-1]), tokens, "stop")
        return Prediction(self.setup.tokenizer.decode(generated), generated, "length")


class HfArm(GenerateArm):
    name = "hf"

    def processor(self, k: int) -> Any:
        from tooltrie.integrations.hf import TrieLogitsProcessor

        return TrieLogitsProcessor(self.setup.artifact, k)


class XGrammarArm(GenerateArm):
    """XGrammar on the exactly-k EBNF, on CPU: what the string-level stack (and vLLM's ``xgrammar`` backend) can
    express of the contract. Repeats slip through it; the scoring counts them."""

    name = "xgrammar"

    def __init__(self, setup: EvalSetup) -> None:
        super().__init__(setup)
        self._grammars: dict[int, Any] = {}

    @functools.cached_property
    def _compiler(self) -> Any:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=self.setup.tokenizer.tokenizer)  # type: ignore[no-untyped-call]
        vocab = int(self.setup.model.get_output_embeddings().weight.shape[0])
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab,
                                                       stop_token_ids=[self.setup.artifact.eos_id])
        return xgrammar.GrammarCompiler(info)

    def budget(self, k: int) -> int:
        return self.setup.grammar_budget(k)

    def grammar(self, k: int) -> str:
        artifact = self.setup.artifact
        return exactly_k_ebnf(artifact.registry.names, k, artifact.contract)

    def processor(self, k: int) -> Any:
        from xgrammar.contrib.hf import LogitsProcessor

        if k not in self._grammars:
            self._grammars[k] = self._compiler.compile_grammar(self.grammar(k))
        return LogitsProcessor(self._grammars[k])  # one-shot: a new one per generate call


class RetrievalArm(Arm):
    """No language model: the top k tools by a retrieval prior alone (``tooltrie.ranker.PRIORS``), what users often
    pick instead of a decoder. ``retrieval``: dense, the embedding similarity (all-MiniLM-L6-v2) of the query and each
    tool's "name: description"; ``lexical``: BM25 over the words inside the tools' identifiers and text; ``hybrid``:
    the two combined. Always valid, never ordered by k. The prior comes from ``options["retrieval"]`` (a
    ``tooltrie.ranker.Ranker``, its files kept beside the artifact), else a ranker of the artifact's registry."""

    name = "retrieval"
    prior = "dense"

    @functools.cached_property
    def ranker(self) -> Any:
        from tooltrie.ranker import Ranker

        return self.setup.options.get("retrieval") or Ranker(self.setup.artifact.registry)

    def predict(self, queries: Sequence[LabelledQuery]) -> list[Prediction]:
        import numpy as np

        artifact = self.setup.artifact
        scores = self.ranker.prior_scores([query.query for query in queries], self.prior)
        predictions = []
        for query, row in zip(queries, scores, strict=True):
            predictions.append(_answered(artifact, [int(i) for i in np.argsort(-row, kind="stable")[: query.k]]))
        return predictions


class LexicalArm(RetrievalArm):
    name = "lexical"
    prior = "lexical"


class HybridArm(RetrievalArm):
    name = "hybrid"
    prior = "hybrid"


CLAUSE_PRIOR = {"dense": 1.0, "lexical": 1.0}  # the clause-split baseline's plain sum, as its definition has it


class ClausesArm(RetrievalArm):
    """The clause-split baseline for requests that ask several things: the request cut into its asks
    (``tooltrie.asks.split_asks``: sentences, enumerations, connectives, "and" before a verb), each ask scored by the
    plain sum of its dense and lexical z-scores (1:1), and one tool per ask, the best ask-tool pairs first (an ask
    that has a tool, and a tool taken, leave the race); past the asks, the whole request's sum ranks the rest.
    Every ask of every request is embedded in one pass."""

    name = "clauses"

    def predict(self, queries: Sequence[LabelledQuery]) -> list[Prediction]:
        import numpy as np

        from tooltrie.asks import split_asks

        artifact = self.setup.artifact
        asks = [split_asks(query.query) for query in queries]
        texts = [text for query, parts in zip(queries, asks, strict=True) for text in (query.query, *parts)]
        scores = self.ranker.prior_scores(texts, CLAUSE_PRIOR)
        predictions, row = [], 0
        for query, parts in zip(queries, asks, strict=True):
            whole, by_ask = scores[row], scores[row + 1 : row + 1 + len(parts)]
            row += 1 + len(parts)
            chosen = one_per_ask(by_ask, query.k)
            rest = [int(i) for i in np.argsort(-whole, kind="stable") if int(i) not in chosen]
            predictions.append(_answered(artifact, [*chosen, *rest][: query.k]))
        return predictions


class PriorArm(RetrievalArm):
    """The ranker's own prior alone (``options["retrieval"]``, its kind and settings), following the answer as the
    decode does (``Prior.follow``: one tool per ask of a request that asks several things, then the request's
    follow-up): what ``--ranker retrieval`` answers, without running the model (ties here to the lower tool id,
    there to the lower token id)."""

    name = "prior"

    def predict(self, queries: Sequence[LabelledQuery]) -> list[Prediction]:
        import numpy as np

        predictions = []
        for query in queries:
            made = self.ranker.row(query.query, "retrieval", k=query.k)
            if made.scores is None:
                raise ValueError("the prior arm needs a ranker with a prior")
            chosen = made.follow.top(query.k) if made.follow is not None else [
                int(i) for i in np.argsort(-made.scores, kind="stable")[: query.k]]
            predictions.append(_answered(self.setup.artifact, chosen))
        return predictions


def _answered(artifact: Any, tools: Sequence[int]) -> Prediction:
    """The prediction that names ``tools`` (tool ids), in order, as the decode would write them."""
    names = [artifact.registry.names[i] for i in tools]
    return Prediction(text=artifact.contract.render(names), token_ids=[*artifact.token_path(names), artifact.eos_id],
                      finish_reason="stop")


def one_per_ask(scores: Any, k: int) -> list[int]:
    """Tools for asks (``scores [asks, tools]``), at most one per ask and ``k`` in all: the best ask-tool pair first,
    then the best pair of an ask without a tool and a tool not taken, and so on; in the asks' order.

    >>> import numpy as np
    >>> one_per_ask(np.array([[3.0, 2.9, 0.0], [2.0, 2.5, 1.0]]), 2)  # the second ask's best is taken: its next
    [0, 1]
    >>> one_per_ask(np.array([[3.0, 2.9, 0.0], [2.0, 2.5, 1.0]]), 1)
    [0]
    """
    import numpy as np

    values = np.array(scores, dtype=np.float64)
    picked: dict[int, int] = {}
    while len(picked) < min(k, *values.shape):  # each pick takes an ask and a tool out of the race
        ask, tool = np.unravel_index(int(np.argmax(values)), values.shape)
        picked[int(ask)] = int(tool)
        values[ask, :], values[:, tool] = -np.inf, -np.inf
    return [picked[ask] for ask in sorted(picked)]


ARMS: dict[str, Callable[[EvalSetup], Arm]] = {
    "engine": EngineArm,
    "hf": HfArm,
    "unconstrained": UnconstrainedArm,
    "fused": FusedArm,
    "xgrammar": XGrammarArm,
    "retrieval": RetrievalArm,
    "lexical": LexicalArm,
    "hybrid": HybridArm,
    "clauses": ClausesArm,
    "prior": PriorArm,
}
# The arms that rank by a retrieval prior alone (no language model).
PRIOR_ARMS = ("retrieval", "lexical", "hybrid", "clauses", "prior")


def make_arm(name: str, setup: EvalSetup) -> Arm:
    if name in ARMS:
        return ARMS[name](setup)
    if name in VLLM_ARMS:
        from tooltrie.eval.vllm_backend import VllmArm

        return VllmArm(setup, mode=VLLM_ARMS[name])
    raise ValueError(f"unknown arm {name!r}; choose from {', '.join([*ARMS, *VLLM_ARMS])}")


# vLLM arms (GPU only): our logits processor, vLLM's xgrammar structured outputs, and no constraint.
VLLM_ARMS = {"vllm": "trie", "vllm-xgrammar": "grammar", "vllm-unconstrained": "none"}
