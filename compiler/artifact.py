"""The compiled artifact: one safetensors file holding the trie arrays and a JSON header.

The header carries the format version, the contract and its hash, the registry (its tools and sha256), the
tokenizer fingerprint, the separator split, and the device footprint with the placement it implies. Files are
written atomically (temp file + rename), and loading checks everything before anything is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from tooltrie import files
from tooltrie.compiler.contract import Contract
from tooltrie.compiler.tokenizer_info import TokenizerInfo
from tooltrie.compiler.trie import CompiledTrie, Split, phase_of
from tooltrie.errors import ArtifactError, ArtifactMismatchError, RegistryError
from tooltrie.registry.loader import make_registry
from tooltrie.registry.model import Registry

FORMAT = "tooltrie-artifact"
FORMAT_VERSION = 1
# Constant memory is 64 KiB per CUDA module; keep 4 KiB for whatever else the kernel module holds.
CONSTANT_MEMORY_BUDGET = 60 * 1024
_HEADER_KEY = "tooltrie"
# safetensors refuses a header over 100,000,000 bytes; ours is all of it but the arrays' few hundred bytes.
HEADER_LIMIT = 99_000_000
TRIE_ARRAYS = sorted(field.name for field in fields(CompiledTrie))  # what a file holds besides its header


def arrays_sha256(arrays: dict[str, Any]) -> str:
    """Checksum of the trie arrays (names, dtypes, shapes and bytes), so a flipped bit is caught on load."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class CompileStats:
    verified_answers: int
    verified_tools: int


@dataclass(frozen=True, eq=False)
class Artifact:
    """A compiled registry: trie arrays plus everything needed to check it is used with the right inputs."""

    trie: CompiledTrie
    registry: Registry
    contract: Contract
    tokenizer_fingerprint: str
    tokenizer_meta: dict[str, Any]
    split_left: str
    split_right: str
    stats: CompileStats

    @classmethod
    def create(cls, *, registry: Registry, tokenizer: TokenizerInfo, contract: Contract, split: Split,
               trie: CompiledTrie, stats: CompileStats) -> Artifact:
        meta = {"source": tokenizer.source, "eos_token": tokenizer.eos_token, "eos_id": tokenizer.eos_id,
                "vocab_size": tokenizer.vocab_size}
        return cls(trie=trie, registry=registry, contract=contract, tokenizer_fingerprint=tokenizer.fingerprint,
                   tokenizer_meta=meta, split_left=split.left, split_right=split.right, stats=stats)

    @property
    def split(self) -> Split:
        return Split(self.split_left, self.split_right)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer_meta["eos_id"])

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest token id a decode under this grammar can emit (scores must cover it)."""
        return max(int(self.trie.edge_token.max(initial=0)), self.eos_id)

    @functools.cached_property
    def sha256(self) -> str:
        """Identity of the compiled grammar: what it was compiled from, and how."""
        key = json.dumps([FORMAT_VERSION, self.registry.sha256, self.tokenizer_fingerprint, self.contract.sha256,
                          self.split_left, self.split_right])
        return hashlib.sha256(key.encode("utf-8")).hexdigest()

    def placement(self, budget: int = CONSTANT_MEMORY_BUDGET) -> str:
        """``"constant"`` when the device arrays fit the constant-memory budget, else ``"global"``."""
        return "constant" if self.trie.device_bytes <= budget else "global"

    def header(self) -> dict[str, Any]:
        header = self._header_without_tools()
        header["registry"]["tools"] = [tool.content() for tool in self.registry.tools]
        return header

    def header_json(self) -> str:
        """``header()`` as JSON, its tools taken from the registry's canonical JSON (built once, hashed already):
        no dict per tool and no generic encoder, half a second less at 100,000 tools."""
        head = json.dumps(self._header_without_tools(), ensure_ascii=False)
        assert head.endswith("}}"), "the registry is the header's last entry"
        return f'{head[:-2]}, "tools": {self.registry.content_json}}}}}'

    def _header_without_tools(self) -> dict[str, Any]:
        trie = self.trie
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "artifact_sha256": self.sha256,
            "arrays_sha256": arrays_sha256(self.trie.arrays()),
            "contract": self.contract.to_dict(),
            "contract_sha256": self.contract.sha256,
            "tokenizer": {"fingerprint": self.tokenizer_fingerprint, **self.tokenizer_meta},
            "split": {"left": self.split_left, "right": self.split_right},
            "trie": {"tools": trie.n_tools, "tries": trie.n_tries, "nodes": trie.n_nodes, "edges": trie.n_edges,
                     "max_depth": trie.max_depth, "device_bytes": trie.device_bytes,
                     "bytes_per_tool": round(trie.device_bytes / trie.n_tools, 1),
                     "constant_memory_budget": CONSTANT_MEMORY_BUDGET,
                     "fits_constant_memory": self.placement() == "constant"},
            "verification": {"answers": self.stats.verified_answers, "tools": self.stats.verified_tools},
            # Last, with its tools last: header_json appends them.
            "registry": {"name": self.registry.name, "source": self.registry.source, "sha256": self.registry.sha256},
        }

    def summary(self) -> dict[str, Any]:
        """What ``tooltrie inspect`` prints: placement and sizes first, the tools (name, pointer) last."""
        header = self.header()
        registry = header.pop("registry")
        registry["tools"] = len(self.registry)
        return {
            "placement": self.placement(),
            "trie": header.pop("trie"),
            "registry": registry,
            **header,
            "tools": [{"name": t.name, "pointer": t.pointer} for t in self.registry.tools],
        }

    def save(self, path: str | Path) -> Path:
        """Write atomically: a reader sees the old file or the whole new one, never half of it."""
        header = self.header_json()
        size = len(header.encode("utf-8"))
        if size > HEADER_LIMIT:
            raise ArtifactError(f"{path}: the artifact's header (the registry's text) takes {size:,} bytes; an "
                                f"artifact holds at most {HEADER_LIMIT:,} (shorten the descriptions or split the "
                                "registry)")
        return write_atomically(path, save(dict(self.trie.arrays()), metadata={_HEADER_KEY: header}))

    @classmethod
    def load(cls, path: str | Path, *, tokenizer: TokenizerInfo | None = None, registry: Registry | None = None,
             contract: Contract | None = None) -> Artifact:
        """Read and check an artifact; with ``tokenizer``/``registry``/``contract`` given, refuse a mismatch.

        The header is read and checked (format, version, checksum, the arrays' names) before any array
        is: a file that is not an artifact costs its header, not its tensors."""
        path = Path(path)
        try:
            with safe_open(str(path), framework="np") as handle:
                header = _checked_header(handle.metadata() or {}, path)
                names = list(handle.keys())
                missing = sorted(set(TRIE_ARRAYS) - set(names))
                if missing:
                    raise ArtifactError(f"{path}: missing trie arrays: {missing}")
                arrays = {name: handle.get_tensor(name) for name in names}
        except ArtifactError:
            raise
        except FileNotFoundError:
            raise ArtifactError(f"{path}: artifact not found") from None
        except (SafetensorError, OSError, ValueError) as exc:
            raise ArtifactError(f"{path}: not a readable tooltrie artifact (truncated or corrupt?): {exc}") from None
        if header["arrays_sha256"] != arrays_sha256(arrays):
            raise ArtifactError(f"{path}: the trie arrays do not match the checksum in the header (corrupt file?)")
        artifact = cls._from_header(header, arrays, path)
        artifact.check_compatible(tokenizer=tokenizer, registry=registry, contract=contract, where=str(path))
        return artifact

    @classmethod
    def _from_header(cls, header: dict[str, Any], arrays: dict[str, Any], path: Path) -> Artifact:
        try:
            reg = header["registry"]
            registry = make_registry(reg["tools"], name=reg["name"], source=reg["source"])
            contract = Contract.from_dict(header["contract"])
            tokenizer = dict(header["tokenizer"])
            fingerprint = tokenizer.pop("fingerprint")
            verification = header["verification"]
            artifact = cls(trie=CompiledTrie.from_arrays(arrays), registry=registry, contract=contract,
                           tokenizer_fingerprint=fingerprint, tokenizer_meta=tokenizer,
                           split_left=header["split"]["left"], split_right=header["split"]["right"],
                           stats=CompileStats(verified_answers=verification["answers"],
                                              verified_tools=verification["tools"]))
        except (KeyError, TypeError, ValueError, RegistryError) as exc:
            raise ArtifactError(f"{path}: malformed header: {exc!r}") from None
        if registry.sha256 != reg.get("sha256"):
            raise ArtifactError(f"{path}: the registry in the header does not match its recorded sha256")
        if contract.sha256 != header.get("contract_sha256"):
            raise ArtifactError(f"{path}: the contract in the header does not match its recorded sha256")
        artifact.trie.validate()
        if artifact.trie.n_tools != len(registry):
            raise ArtifactError(f"{path}: trie has {artifact.trie.n_tools} tools, header lists {len(registry)}")
        return artifact

    def check_compatible(self, *, tokenizer: TokenizerInfo | None = None, registry: Registry | None = None,
                         contract: Contract | None = None, where: str = "artifact") -> None:
        """Raise :class:`ArtifactMismatchError` naming what differs from what this artifact was compiled for."""
        if tokenizer is not None and tokenizer.fingerprint != self.tokenizer_fingerprint:
            raise ArtifactMismatchError(
                f"{where}: compiled for tokenizer {self.tokenizer_meta.get('source')} (fingerprint "
                f"{self.tokenizer_fingerprint[:12]}), used with {tokenizer.source} (fingerprint "
                f"{tokenizer.fingerprint[:12]}); recompile with this tokenizer")
        if registry is not None and registry.sha256 != self.registry.sha256:
            raise ArtifactMismatchError(
                f"{where}: compiled for registry {self.registry.name!r} (sha256 {self.registry.sha256[:12]}, "
                f"{len(self.registry)} tools), used with {registry.name!r} from {registry.source} (sha256 "
                f"{registry.sha256[:12]}, {len(registry)} tools); recompile the registry")
        if contract is not None and contract.sha256 != self.contract.sha256:
            raise ArtifactMismatchError(
                f"{where}: compiled for contract {self.contract.to_dict()} (sha256 {self.contract.sha256[:12]}), "
                f"used with {contract.to_dict()} (sha256 {contract.sha256[:12]})")

    def token_path(self, names: list[str]) -> list[int]:
        """The token ids of an answer, read off the trie (without the stop token)."""
        index = {name: tool for tool, name in enumerate(self.registry.names)}
        ids: list[int] = []
        for position, name in enumerate(names):
            phase = phase_of(position, len(names))
            edges = self.trie.tool_path(int(self.trie.phase_trie[phase]), index[name])
            ids += self.trie.edge_token[edges].tolist()
        return ids


def _checked_header(metadata: dict[str, str], path: Path) -> dict[str, Any]:
    """The tooltrie header of a safetensors file's metadata, checked as far as it can be without the arrays: a JSON
    object of this format and version, with the arrays' checksum."""
    try:
        header = json.loads(metadata[_HEADER_KEY])
    except (KeyError, json.JSONDecodeError):
        raise ArtifactError(f"{path}: safetensors file without a tooltrie header") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: the tooltrie header is not a JSON object")
    if header.get("format") != FORMAT or header.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format {header.get('format')!r} version {header.get('format_version')!r}, "
                            f"expected {FORMAT!r} version {FORMAT_VERSION}")
    if not isinstance(header.get("arrays_sha256"), str):
        raise ArtifactError(f"{path}: the header has no checksum of the trie arrays (written by an older "
                            "tooltrie?); recompile the registry")
    return header


def write_atomically(path: str | Path, blob: bytes) -> Path:
    """Write ``blob`` to ``path`` so that a reader sees the old file or the whole new one, never half of it
    (``tooltrie.files``). A path that cannot be written (a directory there, a read-only folder) is an
    ``ArtifactError`` naming it."""
    try:
        return files.write_atomically(path, blob)
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot write the artifact there: {exc}") from None
