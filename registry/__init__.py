"""Tool registries: loading, validation, and the bundled catalogs.

Bundled (see ``registry/ATTRIBUTION.md``):

- ``CATALOG_PATH``: the 47-tool MetaTool catalog, the embedded default;
- ``BFCL_PATH``: the 1,853-name BFCL registry, the benchmark registry;
- ``OPENAPI_DIR``: OpenAPI 3 documents of two REST APIs (``tmdb.json``, ``spotify.json``), as RestBench keeps them.
"""

from __future__ import annotations

from pathlib import Path

from tooltrie.registry.loader import load_registry, make_registry, parse_registry, tool_list_registry
from tooltrie.registry.model import Registry, Tool
from tooltrie.registry.subsets import select_tools

CATALOG_PATH = Path(__file__).with_name("catalog.yaml")
BFCL_PATH = Path(__file__).with_name("bfcl.jsonl")
OPENAPI_DIR = Path(__file__).with_name("apis")

__all__ = ["BFCL_PATH", "CATALOG_PATH", "OPENAPI_DIR", "Registry", "Tool", "load_registry", "make_registry",
           "parse_registry", "select_tools", "tool_list_registry"]
