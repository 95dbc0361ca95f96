"""pytest's doctest collection imports every module of the folders in ``testpaths``; a module that exists only for
an optional extra that is not installed is left out rather than failing the collection."""

from __future__ import annotations

import importlib.util

OPTIONAL = {"integrations/vllm.py": "vllm"}  # module -> the package it cannot be imported without

collect_ignore = [path for path, package in OPTIONAL.items() if importlib.util.find_spec(package) is None]
