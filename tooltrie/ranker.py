"""What the constrained decode ranks tools by: the model, a retrieval prior, or both fused.

- ``model``: the model's scores alone (what an adapter trained on the registry knows);
- ``retrieval``: each tool's prior alone: the answer is the prior's top k, best first;
- ``fused``: ``model * score + retrieval * prior`` for each legal token, the prior being the best among the unused
  allowed tools below the token's edge (``kernels/walk.py``). Never a hard filter: every tool stays reachable, the
  prior only tips the model's choices.

The prior (``PRIORS``) is one score per tool for a query, standardised per query (z-scores over the registry's tools,
so that one weight means the same whatever the query and the registry):

- ``dense``: the cosine similarity of the query's and the tool's embeddings (all-MiniLM-L6-v2 over "name:
  description" and the parameters, ``tooltrie/retrieval.py``);
- ``lexical``: BM25 over the words inside the tools' identifiers and text (``tooltrie/lexical.py``);
- ``hybrid`` (the default): ``HYBRID``'s weighted sum of the two. Requests use the words inside identifiers
  (``calculateNetIncome``), which a small sentence embedding often misses and BM25 finds; prose-like names go the
  other way; the sum was never worse than the better of the two (docs/benchmarks.md#the-retrieval-prior).

>>> import numpy as np
>>> from tooltrie.registry import CATALOG_PATH, load_registry
>>> ranker = Ranker(load_registry(CATALOG_PATH), fused=Weights(model=1.0, retrieval=20.0), prior="lexical")
>>> prior = ranker.row("What will the weather be in Paris?", "fused")
>>> prior.scores.shape, prior.model_weight, prior.weights
((47,), 1.0, Weights(model=1.0, retrieval=20.0))
>>> ranker.registry.names[int(np.argmax(prior.scores))]
'WeatherTool'

A request's prior is computed once, when it is admitted (the service does it off the event loop and off the engine's
step; ``Engine.submit`` for a request that comes without one), never inside a decoding step, where an embedding would
hold up every row of every registry.

Every constant of the prior lives here, each beside where it was chosen: the hybrid's weights (``HYBRID``), how it
follows the answer (``FOLLOW``), and the fused ranker's weights for each kind of model (``UNTRAINED``,
``NO_ADAPTER``, ``SERVE_TRAINED``; a shipped adapter's own are in its record, ``ranker_policy``). The lexical score's
own constants (BM25's k1 and b, the field weights) are the index's, in ``tooltrie/lexical.py``.

The tools' embeddings and their lexical index are computed once per registry version and kept in files beside the
artifact (``embeddings_path``, ``lexical_path``), keyed by the registry's sha256 (and the encoder and the tool text's
version, the index's kind), by one read/write pattern (``tooltrie/kept.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from tooltrie.errors import TooltrieError

if TYPE_CHECKING:  # numpy is imported where it is used: the CLI reads this module's names to build its options
    import numpy as np
    import numpy.typing as npt

    from tooltrie.chains import Chains
    from tooltrie.compiler.artifact import Artifact
    from tooltrie.lexical import LexicalIndex
    from tooltrie.progress import OnProgress
    from tooltrie.registry.model import Registry, Tool

# The rankers and the priors, named once: the request schemas (HTTP, MCP) take these types, the checks these tuples.
RankerName = Literal["model", "retrieval", "fused"]
PriorName = Literal["dense", "lexical", "hybrid"]
RANKERS: tuple[str, ...] = get_args(RankerName)
PRIORS: tuple[str, ...] = get_args(PriorName)
DEFAULT_PRIOR = "hybrid"
ENCODER = "all-MiniLM-L6-v2"
# The hybrid prior's weights on the dense and the lexical z-scores. Chosen leave one registry out on the five
# development registries' validation splits, plainly worded and need-describing requests counting the same, over the
# lexical score that reads names first (bench/sweep_names_first.py; docs/benchmarks.md#a-lexical-score-that-reads-
# names-first): the folds chose 0.15 or 0.2, all five 0.15 (first chosen, the same, on BFCL and the catalog alone).
HYBRID = {"dense": 1.0, "lexical": 0.15}
# How the prior follows the answer (``FollowUp``): after each tool, the request's words that the chosen tools' names
# hold count ``covered`` times in the lexical score, and the lexical z-scores weigh ``lexical`` beside the dense ones
# (the lexical prior alone keeps its weight). Chosen over the hybrid prior on the five development registries'
# validation splits by the mean of two exact-set rates, plainly worded requests of k >= 2 and need-describing ones
# of k = 2, each kind counting the same; each registry held out in turn, the choice made on the other four is scored
# on it (bench/sweep_prior_follow.py --kinds plain,need; docs/benchmarks.md#the-prior-follows-the-answer). A covered
# word counts half; the later tools lean a little more on the request's words than the first (0.2 against 0.15):
# need-describing pairs lose their second tool when they lean more. ``chains``: the bonus, in the prior's z units, of
# a tool that finds an identifier a chosen tool requires (``tooltrie/chains.py``); chosen the same way on the same
# requests (bench/sweep_follow_chains.py; docs/benchmarks.md#chains-a-request-does-not-name).
FOLLOW = {"covered": 0.5, "lexical": 0.2, "chains": 3.0}
# How a request that asks several things is answered (``PerAsk``): each ask's prior is ``(1 - whole)`` times its own
# z-scores plus ``whole`` times the whole request's (an ask alone often leaves out what the request is about: "and
# its director" names no film). Chosen leave one registry out on the five development registries' validation splits
# by the mean of four exact-set rates, plainly worded, need-describing, hand-written compound (``eval/data/compound``)
# and composed requests (``eval/composed.py``) counting the same, the prior alone (bench/sweep_asks.py: 0, 0.25, 0.5,
# 0.75, each with asks for every answer and only for answers of two tools or more; a tool's largest cosine to a
# chosen one subtracted at 0.5 to 4, asks pooled from the request's one encoder pass, more asks than tools merged
# down to k: never chosen; every fold chose 0.25, answers of two tools or more:
# ``Ranker.asks_of``; docs/benchmarks.md#requests-that-ask-several-things).
ASKS = {"whole": 0.25}


class RankerError(TooltrieError, ValueError):
    """An unknown ranker, or one that needs the retrieval model where there is none."""


@dataclass(frozen=True)
class Weights:
    """How much each evidence counts: the model's scores (its logits) and the retrieval prior (its z-scores)."""

    model: float
    retrieval: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


MODEL_ONLY, RETRIEVAL_ONLY = Weights(1.0, 0.0), Weights(0.0, 1.0)
# For a model that was never trained on the registry the prior leads: a prior gap of 0.02 standard deviations
# outweighs a logit gap of 1, so the model decides only among tools the prior finds nearly tied. Chosen leave one
# registry out on the four development registries the shipped adapter never saw, by the mean of the plain and the
# need-describing validation requests' exact-set rates (bench/sweep_untrained.py: weights 5, 10, 20, 50 and the prior
# alone; three folds and all four chose 50, one 20; docs/benchmarks.md#requests-that-describe-a-need). The catalog,
# the fifth development registry, is no fold: the adapter was trained on it and answers there at its own weights.
UNTRAINED = Weights(model=1.0, retrieval=50.0)
# For a model with no adapter at all (never taught to choose tools) the prior decides and the model only breaks its
# near-exact ties. Chosen over the hybrid prior on the catalog's validation splits with the base model (10, 20, 50:
# 104, 104, 105 exact of 169, the hybrid prior alone 105; docs/benchmarks.md#what-the-model-adds-to-the-prior).
NO_ADAPTER = Weights(model=1.0, retrieval=50.0)
# For an adapter ``serve --train`` trained on the registry (``train.recipe.Recipe``): nothing is measured for each
# adapter it trains. Chosen once for the recipe (100, on BFCL's validation split, with an adapter it trained on
# BFCL) when the prior was the raw cosine; the prior is z-scored now, so 100 x the cosine's median spread per query
# there (0.075; catalog 0.079-0.084): the same tilt, not re-tuned.
SERVE_TRAINED = Weights(model=1.0, retrieval=7.5)


@dataclass(frozen=True, eq=False)  # compared by identity: it holds arrays
class FollowUp:
    """How one request's prior follows its answer: called with the tools the answer has committed to, the prior of
    its next tool. The first tool's prior (``first``) holds the lexical z-scores at ``lexical_weight``; for a later
    tool they are scored again, the words of the request (``query``) that the chosen tools' names hold counting
    ``covered`` times, weighed ``later_weight``: a request of several needs names the first in words the first
    tool's name answers, and what it still asks for in the others. The tools that find an identifier a chosen tool
    requires and no chosen tool finds (``chains``, ``tooltrie/chains.py``) gain ``chain_weight``: a request names
    the end of a chain, not the search that starts it. Made with the request's prior, when it is admitted; then each
    committed tool costs one pass over the request's postings and two arrays of the tools
    (``bench/bench_lexical.py``).

    >>> import numpy as np
    >>> from tooltrie.registry import make_registry
    >>> registry = make_registry([{"name": "get_weather"}, {"name": "get_news"}, {"name": "weather_news"}], name="d")
    >>> prior = Ranker(registry, prior="lexical", fused=Weights(0.0, 1.0)).row("weather and news", "fused")
    >>> [registry.names[i] for i in np.argsort(-prior.scores, kind="stable")]  # the first tool: the two words at once
    ['weather_news', 'get_weather', 'get_news']
    >>> follow = prior.follow
    >>> after = FollowUp(follow.first, follow.query, follow.index, follow.tools, 1.0, 1.0, covered=0.0)((2,))
    >>> bool(after[0] == after[1])  # its words answered (counted 0 times), neither counts more than the other
    True
    """

    first: npt.NDArray[np.float32]
    query: str
    index: LexicalIndex
    tools: Sequence[Tool]
    lexical_weight: float
    later_weight: float
    covered: float = FOLLOW["covered"]
    chains: Chains | None = None
    chain_weight: float = 0.0
    words: list[int] = field(init=False)  # the request's words, as the lexical index reads them
    _rest: npt.NDArray[np.float32] = field(init=False, repr=False)  # ``first`` less its lexical part
    _lexical: npt.NDArray[np.float32] = field(init=False, repr=False)  # the first tool's lexical z-scores

    def __post_init__(self) -> None:
        import numpy as np

        words = self.index.words(self.query)
        lexical = standardized(self.index.weighted_scores(words, np.ones(len(words)))[None])[0]
        object.__setattr__(self, "words", words)
        object.__setattr__(self, "_lexical", lexical)
        object.__setattr__(self, "_rest", self.first - np.float32(self.lexical_weight) * lexical)

    def __call__(self, tools: tuple[int, ...]) -> npt.NDArray[np.float32]:
        import numpy as np

        if not tools:
            return self.first
        if self.covered == 1.0:  # no word discounted: the first tool's lexical z-scores, weighed anew
            lexical = self._lexical
        else:
            covered = {word for tool in tools for word in self.index.words(self.tools[tool].name)}
            weights = [self.covered if word in covered else 1.0 for word in self.words]
            lexical = standardized(self.index.weighted_scores(self.words, weights)[None])[0]
        prior: npt.NDArray[np.float32] = (self._rest + self.later_weight * lexical).astype(np.float32)
        if self.chains is not None and self.chain_weight:
            prior[self.chains.wanted(tools)] += np.float32(self.chain_weight)
        return prior

    def top(self, k: int) -> list[int]:
        """The answer of k tools by this prior alone: each the best unused tool by the prior made from those before
        it (what the decode answers with the model's weight at 0; ties here to the lower tool id, there to the lower
        token id)."""
        return _top(self, k)


@dataclass(frozen=True, eq=False)  # compared by identity: it holds arrays
class PerAsk:
    """How the prior of a request that asks several things (``tooltrie.asks.split_asks``) follows its answer: one
    tool for each ask first. ``asks [asks, tools]`` holds each ask's prior (already weighted); the prior of the next
    tool is, for each tool, its best over the asks that have no tool yet, and a committed tool becomes the tool of
    the ask without one that scores it highest (ties to the earlier ask). Once every ask has its tool, the whole
    request's prior ``whole`` follows the answer as a request of one ask does (``then``, a ``FollowUp``; None: it
    stays ``whole``). With the model's weight at 0 the first tools are the best ask-tool pairs, one per ask: the
    best pair, then the best of an ask without a tool and a tool not taken, and so on. Each committed tool costs a
    maximum over the open asks' rows (``bench/bench_asks.py``).

    >>> import numpy as np
    >>> asks = np.array([[3.0, 2.75, 0.0], [2.0, 2.5, 1.0]], np.float32)
    >>> follow = PerAsk(asks, np.zeros(3, np.float32), None)
    >>> follow(()).tolist(), follow((0,)).tolist()  # tool 0 answers the first ask: the second's prior is left
    ([3.0, 2.75, 1.0], [2.0, 2.5, 1.0])
    >>> follow.top(3)  # the best pair (ask 1, tool 0), then ask 2's best not taken, then the whole request's
    [0, 1, 2]
    """

    asks: npt.NDArray[np.float32]
    whole: npt.NDArray[np.float32]
    then: FollowUp | None = None

    def open_asks(self, tools: Sequence[int]) -> list[int]:
        """The asks without a tool once ``tools`` are committed, in order."""
        open_asks = list(range(len(self.asks)))
        for tool in tools:
            if not open_asks:
                break
            column = self.asks[open_asks, tool]
            open_asks.pop(int(column.argmax()))  # argmax: the first of equal scores, the earlier ask
        return open_asks

    def __call__(self, tools: tuple[int, ...]) -> npt.NDArray[np.float32]:
        open_asks = self.open_asks(tools)
        if open_asks:
            best: npt.NDArray[np.float32] = self.asks[open_asks].max(axis=0)
            return best
        return self.whole if self.then is None else self.then(tools)

    def top(self, k: int) -> list[int]:
        """The answer of k tools by this prior alone (``FollowUp.top``)."""
        return _top(self, k)

    def reach(self) -> npt.NDArray[np.float32]:
        """Each tool's best over the asks and the whole request: ``Ranker.reach``'s order, from what is made."""
        import numpy as np

        best: npt.NDArray[np.float32] = np.maximum(self.whole, self.asks.max(axis=0))
        return best


def _top(follow: Callable[[tuple[int, ...]], npt.ArrayLike], k: int) -> list[int]:
    """The k tools a prior that follows its answer answers alone: each the best unused tool by the prior made from
    those before it (what the decode answers with the model's weight at 0; ties here to the lower tool id, there to
    the lower token id)."""
    import numpy as np

    chosen: list[int] = []
    for _ in range(k):
        prior = np.array(follow(tuple(chosen)), np.float64)
        prior[chosen] = -np.inf
        chosen.append(int(np.argmax(prior)))
    return chosen


@dataclass(frozen=True, eq=False)  # compared by identity: it holds an array
class Prior:
    """One request's prior, ready for the decode (``TrieBatch.add``): ``scores`` each tool's prior, already weighted
    (None: the model alone), ``model_weight`` what the model's scores are multiplied by, ``weights`` what was used,
    ``registry_sha256`` the registry version the scores are for (a prior made before a reload is made again), and
    ``follow`` how the prior follows the answer (None: it does not; ``FollowUp``, or ``PerAsk`` for a request that
    asks several things: ``scores`` is then its first tool's prior)."""

    scores: npt.NDArray[np.float32] | None
    model_weight: float
    weights: Weights
    registry_sha256: str
    follow: FollowUp | PerAsk | None = None


# Not a setting of the prior (nothing is chosen by it): the version of ``FollowUp``'s arithmetic, bumped by hand when
# that code changes, so that two processes that make a request's follow-up in turn refuse to disagree
# (``follow_version``, checked by vLLM's processor).
FOLLOW_REVISION = 1


def follow_version() -> str:
    """The version of how a prior follows its answer: ``FollowUp``'s revision and the lexical index's version and
    settings (BM25's parameters, field weights, stop words). Two processes that make a request's follow-up in turn
    (``tooltrie serve --vllm-url`` and vLLM's processor) must agree on it: the processor subtracts its own lexical
    z-scores from the prior it was sent.

    >>> len(follow_version()), follow_version() == follow_version()
    (16, True)
    """
    import hashlib
    import json

    from tooltrie.lexical import VERSION, index_settings

    key = json.dumps({"follow": FOLLOW_REVISION, "lexical": VERSION, "settings": index_settings()}, sort_keys=True)
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def check_ranker(name: str, *, where: str = "request") -> str:
    if name not in RANKERS:
        raise RankerError(f"{where}: unknown ranker {name!r}; choose one of {', '.join(RANKERS)}")
    return name


def check_prior(name: str, *, where: str = "request") -> str:
    if name not in PRIORS:
        raise RankerError(f"{where}: unknown prior {name!r}; choose one of {', '.join(PRIORS)}")
    return name


def prior_parts(name: str) -> dict[str, float]:
    """The weight of each score (``dense``, ``lexical``) in prior ``name``'s sum of z-scores.

    >>> prior_parts("lexical"), prior_parts("hybrid") == HYBRID
    ({'lexical': 1.0}, True)
    """
    kind = check_prior(name, where="prior")
    return dict(HYBRID) if kind == "hybrid" else {kind: 1.0}


def needs_encoder(name: str) -> bool:
    """Whether prior ``name`` is made with the sentence encoder (all-MiniLM-L6-v2): dense and hybrid are; lexical
    needs only bm25s.

    >>> [prior for prior in PRIORS if needs_encoder(prior)]
    ['dense', 'hybrid']
    """
    return "dense" in prior_parts(name)


def standardized(scores: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Each row's z-scores: minus its mean, over its standard deviation; a row with no spread (a query no tool's word
    matches, a registry of one tool) is all 0, never NaN.

    >>> import numpy as np
    >>> print(standardized(np.array([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])).round(3))
    [[-1.225  0.     1.225]
     [ 0.     0.     0.   ]]
    """
    import numpy as np

    values = np.asarray(scores, dtype=np.float64)
    centred = values - values.mean(axis=1, keepdims=True)
    spread = centred.std(axis=1, keepdims=True)
    z: npt.NDArray[np.float32] = np.divide(centred, spread, out=np.zeros_like(centred),
                                           where=spread > 1e-12).astype(np.float32)
    return z


class Ranker:
    """Per-request priors for a registry: the rows the decode's fused ranker reads (``TrieBatch.add``)."""

    def __init__(self, registry: Registry, *, fused: Weights = UNTRAINED, prior: str = DEFAULT_PRIOR,
                 embeddings_path: str | Path | None = None, lexical_path: str | Path | None = None,
                 encoder: Any = None, follow: bool = True, asks: bool = True) -> None:
        """``follow``: whether a request's prior follows its answer (``FollowUp``; for a prior with a lexical part);
        ``asks``: whether a request that asks several things gets one tool per ask first (``PerAsk``; with
        ``follow``)."""
        self.registry, self.fused, self._encoder, self.follow = registry, fused, encoder, follow
        self.asks = asks
        self.progress: OnProgress | None = None  # told after each chunk of tools embedded (a command's bar)
        self.prior = check_prior(prior, where="prior")
        self.embeddings_path = None if embeddings_path is None else Path(embeddings_path)
        self.lexical_path = None if lexical_path is None else Path(lexical_path)
        self._encoding = threading.Lock()  # requests are ranked on several threads; one encoder pass at a time
        # The lexical index is read or built once, whichever thread asks first; the others wait for it (a build takes
        # 1.6 s at 100,000 tools, holding the GIL). A lock of its own: a build never waits for an encoder pass.
        self._indexing = threading.Lock()
        self._lexical: LexicalIndex | None = None

    def weights(self, name: str) -> Weights:
        return {"model": MODEL_ONLY, "retrieval": RETRIEVAL_ONLY, "fused": self.fused}[check_ranker(name)]

    def row(self, query: str, name: str, *, k: int | None = None, prior: str | None = None,
            scores: npt.NDArray[np.float32] | None = None) -> Prior:
        """The prior of one request asking for ranker ``name``: the one per-request entry point. ``prior``: dense,
        lexical or hybrid (None: the ranker's own); ``scores``: the query's ``prior_scores`` of that kind when the
        caller has them already (a pre-filter ranked by them), so the query is embedded once per request; a request
        that asks several things has its asks scored too, in one batch (``PerAsk``), unless its answer is of one tool
        (``k``: the answer's size; None: any), which answers the whole request."""
        weights = self.weights(name)
        if weights.retrieval == 0:
            return Prior(None, weights.model, weights, self.registry.sha256)
        if scores is None:
            scores = self.prior_scores([query], prior)[0]
        asks = self.asks_of(query, k)
        by_ask = self.ask_scores(asks, scores, prior)  # a batch of their own: padded to the longest ask
        whole = (weights.retrieval * scores).astype("float32")
        then = self.follow_up(query, whole, weights.retrieval, prior)
        if not asks:
            return Prior(whole, weights.model, weights, self.registry.sha256, then)
        per_ask = PerAsk((weights.retrieval * by_ask).astype("float32"), whole, then)
        return Prior(per_ask(()), weights.model, weights, self.registry.sha256, per_ask)

    def ask_scores(self, asks: Sequence[str], scores: npt.NDArray[np.float32],
                   prior: str | None = None) -> npt.NDArray[np.float32]:
        """[len(asks), tools] each ask's prior (``asks_of``) beside its request's (``scores``: its ``prior_scores``),
        blended as ``ASKS`` says."""
        import numpy as np

        if not asks:
            return np.zeros((0, len(scores)), np.float32)
        blend = ASKS["whole"]
        blended: npt.NDArray[np.float32] = ((1 - blend) * self.prior_scores(list(asks), prior)
                                            + blend * scores).astype(np.float32)
        return blended

    def reach(self, query: str, scores: npt.NDArray[np.float32], prior: str | None = None, *,
              k: int | None = None) -> npt.NDArray[np.float32]:
        """What a pre-filter keeps tools by: the request's prior scores (``scores``), or for a request that asks
        several things (``asks_of``) each tool's best over them and its asks' (each ask keeps its tools, not only the
        first)."""
        import numpy as np

        by_ask = self.ask_scores(self.asks_of(query, k), scores, prior)
        return scores if not len(by_ask) else np.maximum(scores, by_ask.max(axis=0))

    def asks_of(self, query: str, k: int | None = None) -> list[str]:
        """The asks of ``query`` its prior answers one by one (``PerAsk``): none for a request that asks one thing,
        for an answer of one tool (``k`` = 1: the best tool for the whole request; every fold of
        ``bench/sweep_asks.py`` chose so), or when the prior does not follow its answer."""
        if not (self.follow and self.asks) or k == 1:
            return []
        from tooltrie.asks import split_asks

        asks = split_asks(query)
        return asks if len(asks) > 1 else []

    def follow_up(self, query: str, first: npt.NDArray[np.float32], retrieval: float,
                  prior: str | None = None) -> FollowUp | None:
        """How the prior ``first`` of ``query`` (prior ``prior``, weighted ``retrieval``) follows the answer; None
        when it does not: no lexical part, or ``follow`` off."""
        parts = prior_parts(prior or self.prior)
        if not self.follow or "lexical" not in parts:
            return None
        from tooltrie.chains import Chains

        later = FOLLOW["lexical"] if "dense" in parts else parts["lexical"]
        return FollowUp(first, query, self.lexical, self.registry.tools, retrieval * parts["lexical"],
                        retrieval * later, FOLLOW["covered"], Chains.of(self.registry), retrieval * FOLLOW["chains"])

    def prior_scores(self, queries: list[str], prior: str | Mapping[str, float] | None = None
                     ) -> npt.NDArray[np.float32]:
        """[len(queries), tools] the prior (``PRIORS``; None: the ranker's own; or its parts as a value,
        ``{"dense": 1.0, "lexical": 1.0}``: a sum of z-scores a study or a baseline tries), z-scores per query."""
        import numpy as np

        weights = dict(prior) if isinstance(prior, Mapping) else prior_parts(prior or self.prior)
        unknown = set(weights) - {"dense", "lexical"}
        if unknown:
            raise RankerError(f"prior: unknown part(s) {', '.join(sorted(unknown))}; a prior sums dense and lexical")
        shape = (len(queries), len(self.registry))
        total = np.zeros(shape, dtype=np.float32)
        if "dense" in weights:
            total += weights["dense"] * standardized(self.similarities(queries))
        if "lexical" in weights:
            lexical = np.array([self.lexical.scores(query) for query in queries], dtype=np.float32).reshape(shape)
            total += weights["lexical"] * standardized(lexical)
        return total

    def rank_indices(self, query: str, k: int, *, prior: str | None = None) -> list[int]:
        """The ``k`` best tool ids by the prior, best first (ties to the lower id): what the pre-filter keeps."""
        import numpy as np

        order = np.argsort(-self.prior_scores([query], prior)[0], kind="stable")
        return [int(i) for i in order[:k]]

    @property
    def lexical(self) -> LexicalIndex:
        """The tools' lexical index: read from ``lexical_path`` when it holds this registry's, else built (and
        written there); once, whichever thread asks first."""
        index = self._lexical
        if index is None:
            with self._indexing:
                if self._lexical is None:
                    from tooltrie.lexical import LexicalIndex

                    self._lexical = LexicalIndex.cached(self.registry, self.lexical_path)
                index = self._lexical
        return index

    def similarities(self, queries: list[str]) -> npt.NDArray[np.float32]:
        """[len(queries), tools] cosine similarities of the queries to the tools' texts (``retrieval.tool_text``)."""
        with self._encoding:  # also makes the lazy encoder and tool embeddings once, whichever thread comes first
            tools = self.tool_embeddings
            query_embeddings = self.encoder.encode(queries).numpy()
        result: npt.NDArray[np.float32] = (query_embeddings @ tools.T).astype("float32")
        return result

    def kept(self) -> dict[str, tuple[Path, bool]]:
        """Each part of the prior kept in a file (``lexical``, ``embeddings``): the file, and whether it holds this
        registry version's (read, never made here). No file configured, or no torch to make embeddings with (the
        model extra): the part is not listed."""
        import importlib.util

        parts: dict[str, tuple[Path, bool]] = {}
        if self.lexical_path is not None:
            from tooltrie.lexical import LexicalIndex

            parts["lexical"] = (self.lexical_path, LexicalIndex.read(self.registry, self.lexical_path) is not None)
        if self.embeddings_path is not None and importlib.util.find_spec("torch") is not None:
            parts["embeddings"] = (self.embeddings_path, self._kept_embeddings() is not None)
        return parts

    def _kept_embeddings(self) -> npt.NDArray[np.float32] | None:
        from tooltrie.kept import read_kept

        kept: npt.NDArray[np.float32] | None = read_kept(self.embeddings_path, self._embeddings_key(),
                                                         lambda arrays, meta: arrays["embeddings"], what="embeddings")
        return kept

    def _embeddings_key(self) -> dict[str, str]:
        """What kept embeddings must have been made for: this registry version, the encoder and the precision it
        runs in (bfloat16 where the CPU has it natively: ``SentenceEncoder``), the tool text's form."""
        from tooltrie.precision import native_bf16
        from tooltrie.retrieval import TEXT_VERSION, RetrievalError

        try:  # the encoder made, not loaded: what it runs in
            precision = getattr(self.encoder, "precision", "float32")
        except RetrievalError:  # all-MiniLM-L6-v2 is not installed (inspect): what it would run in
            precision = "bfloat16" if native_bf16() else "float32"
        encoder = ENCODER if precision == "float32" else f"{ENCODER}@{precision}"
        return {"registry_sha256": self.registry.sha256, "encoder": encoder, "text": TEXT_VERSION}

    @cached_property
    def encoder(self) -> Any:
        from tooltrie.retrieval import SentenceEncoder

        return self._encoder or SentenceEncoder()

    @cached_property
    def tool_embeddings(self) -> npt.NDArray[np.float32]:
        """The tools' embeddings: read from ``embeddings_path`` when it holds this registry's, else computed (and
        written there, a chunk at a time as they are made: a run that stops continues where it stopped;
        ``tooltrie/embeddings.py``), reporting to ``progress`` after each chunk."""
        from tooltrie.embeddings import embed_texts
        from tooltrie.retrieval import tool_text

        cached = self._kept_embeddings()
        if cached is not None:
            return cached
        texts = [tool_text(tool) for tool in self.registry.tools]
        return embed_texts(self.encoder.encode, texts, self.embeddings_path, self._embeddings_key(),
                           progress=self.progress)


def ranker_for(artifact: Artifact, source: str | Path | None, weights: Weights, *,
               prior: str = DEFAULT_PRIOR, follow: bool = True, asks: bool = True,
               progress: OnProgress | None = None) -> Ranker:
    """The ``Ranker`` of an artifact. The tools' embeddings and lexical index are kept beside ``source`` when it is
    a compiled artifact, else in the compile cache (keyed by the registry's sha256); ``progress`` is told as the
    tools are embedded (``tooltrie/progress.py``)."""
    from tooltrie.compiler.cache import default_cache_dir
    from tooltrie.compiler.sources import is_artifact

    beside = Path(source) if source is not None and is_artifact(source) else (
        default_cache_dir() / f"{artifact.registry.sha256[:32]}.safetensors")
    ranker = Ranker(artifact.registry, fused=weights, prior=prior, embeddings_path=embeddings_path(beside),
                    lexical_path=lexical_path(beside), follow=follow, asks=asks)
    ranker.progress = progress
    return ranker


def embeddings_path(artifact_path: str | Path) -> Path:
    """Where the tools' embeddings of an artifact are kept: beside it."""
    path = Path(artifact_path)
    return path.with_name(path.name.removesuffix(".safetensors") + ".embeddings.safetensors")


def lexical_path(artifact_path: str | Path) -> Path:
    """Where the tools' lexical index of an artifact is kept: beside it."""
    path = Path(artifact_path)
    return path.with_name(path.name.removesuffix(".safetensors") + ".lexical.safetensors")


__all__ = ["ASKS", "DEFAULT_PRIOR", "FOLLOW", "FOLLOW_REVISION", "HYBRID", "NO_ADAPTER", "PRIORS", "RANKERS",
           "SERVE_TRAINED", "UNTRAINED", "FollowUp", "PerAsk", "Prior", "PriorName", "Ranker", "RankerError",
           "RankerName", "Weights", "check_prior", "check_ranker", "embeddings_path", "follow_version", "lexical_path",
           "needs_encoder", "prior_parts", "ranker_for", "standardized"]
