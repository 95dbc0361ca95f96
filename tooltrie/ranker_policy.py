"""Which ranker ``--ranker auto`` picks, and the fused ranker's weights, for a model and a registry.

An adapter's record (``ranker`` in ``tooltrie.json``, ``tooltrie.serve.adapter``) says how its answers rank on the
registry it was trained on, and only there; anywhere else the model does not know the tools, and the retrieval prior
leads (``UNTRAINED``). The entry holds what was measured for that adapter, or says that nothing was:

- ``auto``: the ranker a measurement on its registry chose, written only beside that measurement (``chosen_on``);
- ``fused``: the fused ranker's weights, measured (``chosen_on``) or given by how it was trained (``fused_from``:
  ``serve --train``'s recipe, or the prior weight it was trained through, beside ``prior``, the prior kind it was
  trained through: a record, the server's ``--prior`` chooses what it is served with).

Without ``auto``, nothing chose between the rankers for that adapter: it answers fused where the record gives fused
weights (the prior is never a hard filter, and those weights are what its training was made for), else alone.

A model with no adapter at all (``--base``, or a model directory without a record) was never taught to choose tools:
it answers by the prior alone (``retrieval``). Fused, the base SmolLM2 added nothing to the hybrid prior on the
catalog's validation splits at any weight (10, 20, 50; docs/benchmarks.md#what-the-model-adds-to-the-prior), where
the shipped adapter, on registries it never saw, adds to it (BFCL's validation and test splits).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from tooltrie.compiler import provenance
from tooltrie.ranker import MODEL_ONLY, NO_ADAPTER, UNTRAINED, Weights

if TYPE_CHECKING:
    from tooltrie.compiler.artifact import Artifact

__all__ = ["TrainedAdapter", "auto_ranker", "fused_weights"]


class TrainedAdapter(provenance.MadeFor, Protocol):
    """What the policy reads of an adapter (``serve.adapter.AdapterRecord``): what it was trained on, and its
    record."""

    @property
    def record(self) -> Mapping[str, Any]: ...


def auto_ranker(adapter: TrainedAdapter | None, artifact: Artifact, *, retrieval: bool) -> str:
    """What ``--ranker auto`` ranks ``artifact``'s answers by, for a model with ``adapter``. On the registry the
    adapter was trained on: what a measurement there chose (``ranker.auto``), else fused where its record gives fused
    weights, else the model alone. Elsewhere the fused ranker; without an adapter the prior alone. Never a ranker that
    needs a prior where it cannot be made (``retrieval``: whether it can, e.g. all-MiniLM-L6-v2 is installed for a
    dense or hybrid prior)."""
    if not retrieval:
        return "model"
    if adapter is None:
        return "retrieval"
    measured = _measured(adapter, artifact)
    if measured is None:
        return "fused"
    return str(measured.get("auto", "fused" if "fused" in measured else "model"))


def fused_weights(adapter: TrainedAdapter | None, artifact: Artifact) -> Weights:
    """The fused ranker's weights for a model with ``adapter`` on ``artifact``. On the registry the adapter was
    trained on: the adapter's own (``ranker.fused`` in its record), else the model alone (nothing says retrieval
    helps it there). Anywhere else ``UNTRAINED``: a model that does not know the tools lets the retrieval prior
    lead; without an adapter ``NO_ADAPTER``: the prior decides, the model breaks its ties."""
    if adapter is None:
        return NO_ADAPTER
    measured = _measured(adapter, artifact)
    if measured is None:
        return UNTRAINED
    own = measured.get("fused")
    return MODEL_ONLY if own is None else Weights(model=float(own["model"]), retrieval=float(own["retrieval"]))


def _measured(adapter: TrainedAdapter | None, artifact: Artifact) -> Mapping[str, Any] | None:
    """The adapter record's ``ranker`` entry when the adapter was trained for ``artifact`` (empty when it has
    none), else None."""
    if adapter is None or provenance.differences(adapter, artifact, made="trained on"):
        return None
    measured: Mapping[str, Any] = adapter.record.get("ranker", {})
    return measured
