"""The frozen contract: how an answer is written as text.

An answer is the tool names in order, joined by the separator, ended by the model's stop token (the tokenizer's
EOS, appended as a token id, never as text). ``render`` makes training targets and is what the compiler
tokenizes; ``parse`` is what evaluation scores through. Its version and hash are stored in every artifact.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from tooltrie.errors import RegistryError

CONTRACT_VERSION = 1


@dataclass(frozen=True)
class Contract:
    """Render and parse ranked tool lists.

    >>> contract = Contract()
    >>> contract.render(["NewsTool", "FinanceTool"])
    'NewsTool, FinanceTool'
    >>> contract.parse("NewsTool, FinanceTool")
    ['NewsTool', 'FinanceTool']
    """

    separator: str = ", "
    version: int = CONTRACT_VERSION

    def __post_init__(self) -> None:
        if not self.separator:
            raise ValueError("the contract's separator must not be empty")
        if self.version != CONTRACT_VERSION:
            raise ValueError(f"contract version {self.version} is not supported (this is {CONTRACT_VERSION})")

    def render(self, names: Sequence[str]) -> str:
        return self.separator.join(names)

    def parse(self, text: str, *, stop_text: str | None = None) -> list[str]:
        """Split an answer back into names; a trailing ``stop_text`` (the decoded stop token) is dropped."""
        if stop_text and text.endswith(stop_text):
            text = text[: -len(stop_text)]
        return text.split(self.separator) if text else []

    def check_name(self, name: str, where: str) -> None:
        """Refuse a name that could not be parsed back out of a rendered answer."""
        if self.separator in name:
            raise RegistryError(f"{where}: tool name contains the contract's separator {self.separator!r}")

    def to_dict(self) -> dict[str, object]:
        return {"version": self.version, "separator": self.separator, "stop": "eos"}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Contract:
        separator, version = data.get("separator"), data.get("version")
        if not isinstance(separator, str) or not isinstance(version, int):
            raise ValueError(f"malformed contract {data!r}")
        return cls(separator=separator, version=version)

    @property
    def sha256(self) -> str:
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

