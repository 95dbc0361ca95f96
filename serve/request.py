"""One discovery request, from admission to answer, and the answer it gets.

A :class:`Request` is made once from what the caller sent (HTTP body, MCP call, ``tooltrie ask``, an evaluation's
query) and carries everything that happens to it: what admission decided (``tools``, the allowed tool ids; ``prior``,
the ranker's prior), where it is (``status``), and how it ended (``answer`` or ``error``). The service, the worker
and the engines read and write this one object; the engine's own per-slot bookkeeping (tokens to feed, hidden
states) is the engine's, keyed by the request. Its :class:`Answer` holds the artifact it was decoded under, and
:meth:`Answer.response` is the endpoint's JSON view of it.

:func:`check_request` is the part of admission every engine applies too (the tools a request may name, k against
them, the ranker's name), so a request handed straight to an engine is held to the same rules as a served one.

>>> request = Request("Will it rain in Oslo tomorrow?", 2, deny=("get_news",))
>>> request.status, request.ranked_by
(<RequestStatus.NEW: 'new'>, 'model')
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tooltrie.kernels.state import check_k, check_subset
from tooltrie.ranker import MODEL_ONLY, Prior, Ranker, check_ranker
from tooltrie.registry import Registry
from tooltrie.registry.subsets import select_tools

if TYPE_CHECKING:
    from tooltrie.compiler.artifact import Artifact
    from tooltrie.serve.first import First
    from tooltrie.serve.policy import Tenant


class RequestStatus(enum.Enum):
    """Where a request is: made, admitted, waiting for a slot, decoding, then one of the three ends."""

    NEW = "new"
    WAITING = "waiting"  # handed to an engine (or the worker), not yet in a batch
    DECODING = "decoding"
    FINISHED = "finished"  # ``answer`` is set (its ``finish_reason`` may still be "error" or "length")
    FAILED = "failed"  # ``error`` is set: the request could not be decoded
    CANCELLED = "cancelled"  # its caller left or timed out; nothing is delivered

    @property
    def ended(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED)


@dataclass
class ToolChoice:
    rank: int
    name: str
    pointer: str
    score: float  # log-probability of choosing this tool, under the constraint, given the ones before it
    margin: float  # smallest logit lead of the chosen token over the runner-up at this tool's decision points
    chosen_by: str = "decoded"  # or "named" (the request names it) or "pinned" (serve/first.py): score 0, certain


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
    # The artifact it was decoded under (a reload while decoding does not change it).
    artifact: Artifact | None = field(default=None, compare=False, repr=False)

    def response(self) -> dict[str, Any]:
        """The discovery endpoint's JSON object (also what ``tooltrie ask --json`` prints)."""
        if self.artifact is None:
            raise ValueError("an answer without its artifact has no response (the engine sets it)")
        registry = self.artifact.registry
        return {
            "tools": [{"rank": t.rank, "name": t.name, "pointer": t.pointer, "score": round(t.score, 4),
                       "chosen_by": t.chosen_by} for t in self.tools],
            "finish_reason": self.finish_reason,
            "registry": registry.name,
            "registry_sha256": registry.sha256,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.token_ids),
                      "forward_passes": self.forward_passes, "decision_points": self.decision_points,
                      "speculated": self.speculated},
            "ranker": self.ranker,
            "latency_ms": round(self.latency_ms, 2),
        }


@dataclass(eq=False)  # compared by identity: a request is one question, however alike two of them look
class Request:
    """One discovery question and everything that happens to it.

    What the caller asks: ``query`` and ``k``; ``registry`` (None: the default, the tenant's with a policy);
    ``allow``/``deny`` tool names or tags; ``prefilter`` the top N by retrieval (None: the registry's setting);
    ``tenant`` whom the API key belongs to; ``ranker`` (model, retrieval or fused; None: the server's setting, or
    the model for an engine used directly) and ``prior_kind`` (dense, lexical or hybrid; None: the server's);
    ``constrained=False`` decodes without the grammar (plain greedy, full head); ``reasoning`` lets a reasoning model
    think first (the constraint starts after its end marker); ``max_new_tokens`` bounds unconstrained answers and
    thinking; ``pin`` tool names always in the answer, within k or (``pin_within_k=False``) on top of it.

    What admission decides: ``first`` the tools the answer starts with, named by the query or pinned (``k`` then
    becomes what the decode adds after them: ``serve/first.py``); ``tools`` the ids it may be answered with (None:
    every tool), indices into ``tools_of``, the registry version they were chosen in; ``prior`` the ranker's prior
    (made off the decoding step); ``counted`` whether it counts against the queue limit (the health probe does
    not).
    """

    query: str
    k: int
    registry: str | None = None
    allow: tuple[str, ...] | None = None
    deny: tuple[str, ...] = ()
    prefilter: int | None = None
    tenant: Tenant | None = field(default=None, repr=False)
    ranker: str | None = None
    prior_kind: str | None = None
    constrained: bool = True
    max_new_tokens: int = 64
    reasoning: bool = False
    pin: tuple[str, ...] = ()
    pin_within_k: bool = True
    first: First | None = field(default=None, repr=False)
    tools: frozenset[int] | None = field(default=None, repr=False)
    tools_of: Registry | None = field(default=None, repr=False)
    prior: Prior | None = field(default=None, repr=False)
    counted: bool = True
    status: RequestStatus = RequestStatus.NEW
    answer: Answer | None = field(default=None, repr=False)
    error: BaseException | None = field(default=None, repr=False)
    # Called once on the worker thread when the request ends (answered or failed), never after a cancel.
    deliver: Callable[[Request], None] | None = field(default=None, repr=False)

    @property
    def ranked_by(self) -> str:
        """The ranker its choices use (an engine's default: the model)."""
        return self.ranker or "model"

    def finish(self, answer: Answer) -> None:
        self.answer, self.status = answer, RequestStatus.FINISHED

    def fail(self, error: BaseException) -> None:
        self.error, self.status = error, RequestStatus.FAILED


def check_request(request: Request, artifact: Artifact, *, where: str = "request") -> frozenset[int] | None:
    """The tools ``request`` may be answered with under ``artifact`` (None: all), refused with a ``DecodeError`` (or a
    ``RegistryError``/``RankerError``, both ``ValueError``\\ s) when it cannot be answered there: unknown names in
    ``allow``/``deny``, k outside 1..tools or above the allowed ones, an unknown ranker. Admitted ``tools`` chosen in
    another version of the registry (a reload while the request waited) are found again by name."""
    registry, tools = artifact.registry, request.tools
    if tools is None:
        tools = select_tools(registry, request.allow, request.deny, where=where)
    elif request.tools_of is not None and request.tools_of.sha256 != registry.sha256:
        names = [request.tools_of.tools[tool].name for tool in sorted(tools)]
        tools = select_tools(registry, names, where=where)
    if request.constrained:
        check_k(request.k, len(registry), where=where)
        check_subset(artifact, tools, request.k, where=where)
    check_ranker(request.ranked_by, where=where)
    return tools


def request_prior(request: Request, ranker: Ranker | None, artifact: Artifact) -> Prior | None:
    """The prior ``request`` decodes with under ``artifact`` (None: the model alone): the one admission made, where
    it was made for this registry version and ``ranker``'s weights, else one made now by ``ranker`` with the
    request's own prior kind. Blocking (it may embed the query): an engine calls it at submit, never in a step."""
    if request.ranked_by == "model" or ranker is None:
        return None
    prior, weights = request.prior, ranker.weights(request.ranked_by)
    if prior is None or prior.registry_sha256 != artifact.registry.sha256 or prior.weights != weights:
        prior = ranker.row(request.query, request.ranked_by, k=request.k, prior=request.prior_kind)
    return prior


__all__ = ["Answer", "Request", "RequestStatus", "ToolChoice", "check_request", "request_prior"]
