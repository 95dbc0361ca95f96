"""Shared fixtures: the bundled tokenizers, the bundled registries and their compiled artifacts (session-scoped), and
the network guards (``no_network``: no connection at all; ``loopback_only``: none beyond loopback).

Everything here comes from the repository itself (the bundled tokenizers and registries); no network.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, Registry, load_registry

TOKENIZER_NAMES = ("smollm2-135m", "gpt2")
REGISTRY_NAMES = ("catalog", "bfcl")
_REGISTRY_PATHS = {"catalog": CATALOG_PATH, "bfcl": BFCL_PATH}


@pytest.fixture(scope="session")
def tokenizers() -> dict[str, TokenizerInfo]:
    return {name: TokenizerInfo.load(name) for name in TOKENIZER_NAMES}


@pytest.fixture(scope="session")
def smollm(tokenizers: dict[str, TokenizerInfo]) -> TokenizerInfo:
    return tokenizers["smollm2-135m"]


@pytest.fixture(scope="session")
def gpt2(tokenizers: dict[str, TokenizerInfo]) -> TokenizerInfo:
    return tokenizers["gpt2"]


@pytest.fixture(scope="session")
def registries() -> dict[str, Registry]:
    return {name: load_registry(path) for name, path in _REGISTRY_PATHS.items()}


@pytest.fixture(scope="session")
def catalog(registries: dict[str, Registry]) -> Registry:
    return registries["catalog"]


@pytest.fixture(scope="session")
def bfcl(registries: dict[str, Registry]) -> Registry:
    return registries["bfcl"]


@pytest.fixture(scope="session")
def compiled(
    registries: dict[str, Registry], tokenizers: dict[str, TokenizerInfo]
) -> Callable[[str, str], Artifact]:
    """``compiled(registry_name, tokenizer_name)``: the default-contract artifact, compiled once per session."""
    cache: dict[tuple[str, str], Artifact] = {}

    def get(registry_name: str, tokenizer_name: str) -> Artifact:
        key = (registry_name, tokenizer_name)
        if key not in cache:
            cache[key] = compile_registry(registries[registry_name], tokenizers[tokenizer_name])
        return cache[key]

    return get


@pytest.fixture(scope="session", autouse=True)
def artifact_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The directory vLLM's processor reads artifacts from (``$TOOLTRIE_ARTIFACT_ROOT``): a temporary one, never the
    user's cache."""
    root = tmp_path_factory.mktemp("vllm-artifacts")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOOLTRIE_ARTIFACT_ROOT", str(root))
        yield root


@pytest.fixture(scope="session")
def catalog_artifact(compiled: Callable[[str, str], Artifact]) -> Artifact:
    return compiled("catalog", "smollm2-135m")


@pytest.fixture(scope="session")
def saved_catalog_artifact(catalog_artifact: Artifact, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The catalog artifact (smollm2) saved once; tests must copy it before modifying it."""
    return catalog_artifact.save(tmp_path_factory.mktemp("artifact") / "catalog.trie.safetensors")


def _no_network(*args: object, **kwargs: object) -> None:
    raise AssertionError("tried to open a network connection")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any socket connection: what loads a model must never reach a hub."""
    monkeypatch.setattr(socket.socket, "connect", _no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", _no_network)


_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _check_loopback(address: Any) -> None:
    if isinstance(address, tuple) and not ipaddress.ip_address(address[0]).is_loopback:
        raise AssertionError(f"tried to connect beyond loopback: {address}")


def _loopback_connect(self: socket.socket, address: Any) -> None:
    _check_loopback(address)
    _real_connect(self, address)


def _loopback_connect_ex(self: socket.socket, address: Any) -> int:
    _check_loopback(address)
    return _real_connect_ex(self, address)


@pytest.fixture(scope="module")
def loopback_only() -> Iterator[None]:
    """Fail any socket connection to an address outside 127.0.0.0/8 and ::1, for the whole module (servers on
    loopback are fine: ``pytestmark = pytest.mark.usefixtures("loopback_only")``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", _loopback_connect)
        patch.setattr(socket.socket, "connect_ex", _loopback_connect_ex)
        yield
