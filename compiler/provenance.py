"""What something made for an artifact was made from, and how it differs from another artifact.

Training data (``meta.json``) and an adapter (``tooltrie.json``) each record the registry (name, sha256), the
tokenizer fingerprint and the contract sha256 of the artifact they were made for. Used with another artifact they
are refused or flagged, with one account of what differs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tooltrie.compiler.artifact import Artifact

__all__ = ["MadeFor", "differences"]


class MadeFor(Protocol):
    """The artifact inputs a record names (``train.data.DataMeta``, ``serve.adapter.AdapterRecord``)."""

    @property
    def registry_name(self) -> str: ...
    @property
    def registry_sha256(self) -> str: ...
    @property
    def tokenizer_fingerprint(self) -> str: ...
    @property
    def contract_sha256(self) -> str: ...


def differences(record: MadeFor, artifact: Artifact, *, made: str) -> list[str]:
    """One phrase per input of ``artifact`` that is not the one ``record`` was ``made`` for (e.g. "trained on");
    empty when they all match."""
    registry, contract = artifact.registry, artifact.contract
    found = []
    if record.registry_sha256 != registry.sha256:
        found.append(f"registry {registry.name!r} (sha256 {registry.sha256[:12]}) is not the "
                     f"{record.registry_name!r} it was {made} (sha256 {record.registry_sha256[:12]})")
    if record.tokenizer_fingerprint != artifact.tokenizer_fingerprint:
        found.append(f"tokenizer fingerprint {artifact.tokenizer_fingerprint[:12]} is not the one it was {made} "
                     f"({record.tokenizer_fingerprint[:12]})")
    if record.contract_sha256 != contract.sha256:
        found.append(f"contract {contract.to_dict()} (sha256 {contract.sha256[:12]}) is not the one it was {made} "
                     f"(sha256 {record.contract_sha256[:12]})")
    return found
