"""Labelled query sets: the bundled MetaTool, BFCL, RestBench and ToolAlpaca queries with a fixed held-out test
split, and user JSONL files.

A labelled query is ``{"query": str, "tools": [names]}`` (one JSON object per line; an optional ``"k"`` must equal
the number of tools). Bundled (``eval/data/``, see ``eval/data/ATTRIBUTION.md``):

===================  ==============================  ==========  ===============================  ============
name                 file                            registry    stratum (a group of the split)   test rule
===================  ==============================  ==========  ===============================  ============
metatool-single      metatool/queries_single_47      catalog     the gold tool (47)               10 per tool
metatool-multi       metatool/queries_multi_k2       catalog     the unordered gold pair (88)     20 %
bfcl                 bfcl/queries (labelled only)    bfcl        the BFCL category (10)           10 %
restbench-tmdb       restbench-tmdb/queries          its own     the unordered gold set (75)      halves
restbench-spotify    restbench-spotify/queries       its own     the unordered gold set (50)      halves
toolalpaca           toolalpaca/queries              its own     the unordered gold set (100)     halves
catalog-needs        needs/catalog                   catalog     the unordered gold set           halves
bfcl-needs           needs/bfcl                      bfcl        the unordered gold set           halves
tmdb-needs           needs/tmdb                      tmdb's      the unordered gold set           halves
spotify-needs        needs/spotify                   spotify's   the unordered gold set           halves
toolalpaca-needs     needs/toolalpaca                toolalpaca  the unordered gold set           halves
catalog-compound     compound/catalog                catalog     the unordered gold set           halves
bfcl-compound        compound/bfcl                   bfcl        the unordered gold set           halves
tmdb-compound        compound/tmdb                   tmdb's      the unordered gold set           halves
spotify-compound     compound/spotify                spotify's   the unordered gold set           halves
toolalpaca-compound  compound/toolalpaca             toolalpaca  the unordered gold set           halves
catalog-nofit        nofit/catalog                   catalog     near miss or unrelated           halves
bfcl-nofit           nofit/bfcl                      bfcl        near miss or unrelated           halves
tmdb-nofit           nofit/tmdb                      tmdb's      near miss or unrelated           halves
spotify-nofit        nofit/spotify                   spotify's   near miss or unrelated           halves
toolalpaca-nofit     nofit/toolalpaca                toolalpaca  near miss or unrelated           halves
===================  ==============================  ==========  ===============================  ============

The ``-needs`` sets hold requests that describe a situation or a goal rather than a tool (``"kind": "need"``,
``LabelledQuery.kind``), written by hand for measuring how a ranker copes with wording that is not the registry's
(``eval/data/needs/README.md``; ``python -m tooltrie.eval.wording`` checks they avoid their tools' words). Sizes
(test / validation): 35 / 34, 33 / 32, 32 / 32, 32 / 32, 33 / 33, in the table's order. The ``-compound`` sets hold
requests that ask for several things at once, one tool per ask (``"kind": "compound"``, written by hand:
``eval/data/compound/README.md``), 24 / 24 each (test / validation); the ``-composed`` sets (``catalog-composed``,
``bfcl-composed``, ``tmdb-composed``, ``spotify-composed``, ``toolalpaca-composed``) join 2-4 single-tool requests
of a split into 60 compound requests of that split (``eval/composed.py``). ``catalog-situations`` holds need-describing
requests written separately to train on (``eval/data/situations/README.md``): all of it is its train split, less
any text a test split holds. The ``-nofit`` sets hold requests no tool of the registry serves (``"kind": "none"``,
no gold tools, ``near``: the closest tools of a near miss; ``eval/data/nofit/README.md``), 24 / 24 each.

**The split rule** (fixed, deterministic, no seed): within each stratum, queries are ordered by the sha256 of their
normalized text (``normalize``: NFKC, case-folded, whitespace collapsed), ties by line. The first ones are the test
split: a fixed count, or a fraction rounded half up and at least one. The test texts of *every* bundled set are then
withheld from every other split of every set, so a text that is tested anywhere is never trained on. What remains
of the set, in the same hash order (not by stratum), gives its first 5 % (rounded half up) to the validation split;
the rest, less any text already in validation, is the train split. Sizes (test / validation / train): 470 / 507 /
9,638 (metatool-single), 118 / 19 / 360 (metatool-multi), 250 / 112 / 2,137 (bfcl); a test pins the test splits.

**Halves** (the three small development registries, RestBench's TMDB and Spotify and ToolAlpaca, each with its own
registry ``<name>/<name>.json``, an OpenAI tools list; a few dozen to two hundred queries, most gold sets seen
once): no train split. The queries are ordered by stratum (the gold set's sorted names), then by text hash, then by
line, and alternate down that order, test first: every stratum is split as evenly as it can be, and the strata seen
once fall about evenly between the two halves. Test texts of every set are then withheld from the validation half
as above. Sizes (test / validation): 50 / 50 (restbench-tmdb), 28 / 28 (restbench-spotify), 104 / 104 (toolalpaca).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tooltrie.errors import TooltrieError
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, Registry

DATA_DIR = Path(__file__).with_name("data")
SPLITS = ("train", "validation", "test")
VALIDATION_FRACTION = 0.05


class DatasetError(TooltrieError, ValueError):
    """A labelled query file is malformed, or a label cannot be answered under a registry; names file:line."""


@dataclass(frozen=True)
class LabelledQuery:
    """A query and its gold tools, in order; ``where`` is ``file:line`` for error messages."""

    query: str
    tools: tuple[str, ...]
    where: str = ""
    category: str = ""  # BFCL's category; empty elsewhere
    kind: str = ""  # "need" for a request that describes a situation (eval/data/needs/); empty: plainly worded;
    # "none" for one that no tool of the registry serves (eval/data/nofit/: no gold tools, k = 0)
    near: tuple[str, ...] = ()  # a "none" request's nearest tools (a near miss); empty: unrelated to the registry

    @property
    def k(self) -> int:
        return len(self.tools)

    @functools.cached_property
    def text_hash(self) -> str:
        return text_hash(self.query)


@dataclass(frozen=True)
class _Bundled:
    file: str
    registry: Path
    stratum: str  # "tool" | "tool-set" | "category" | "near" (a near miss or not)
    test_count: int = 0  # per stratum; else test_fraction
    test_fraction: float = 0.0
    halves: bool = False  # test and validation alternate down the stratum-then-hash order; no train split
    train_only: bool = False  # every query (less the held-out texts) is for training: no test or validation split


BUNDLED: dict[str, _Bundled] = {
    "metatool-single": _Bundled("metatool/queries_single_47.jsonl", CATALOG_PATH, "tool", test_count=10),
    "metatool-multi": _Bundled("metatool/queries_multi_k2.jsonl", CATALOG_PATH, "tool-set", test_fraction=0.2),
    "bfcl": _Bundled("bfcl/queries.jsonl", BFCL_PATH, "category", test_fraction=0.1),
    **{name: _Bundled(f"{name}/queries.jsonl", DATA_DIR / name / f"{name}.json", "tool-set", halves=True)
       for name in ("restbench-tmdb", "restbench-spotify", "toolalpaca")},
    # need-describing requests, written by hand (eval/data/needs/README.md): a situation, not the tool's words
    **{f"{name}-needs": _Bundled(f"needs/{name}.jsonl", registry, "tool-set", halves=True)
       for name, registry in (("catalog", CATALOG_PATH), ("bfcl", BFCL_PATH),
                              ("tmdb", DATA_DIR / "restbench-tmdb" / "restbench-tmdb.json"),
                              ("spotify", DATA_DIR / "restbench-spotify" / "restbench-spotify.json"),
                              ("toolalpaca", DATA_DIR / "toolalpaca" / "toolalpaca.json"))},
    # compound requests, written by hand: 2-4 asks, one tool each (eval/data/compound/README.md)
    **{f"{name}-compound": _Bundled(f"compound/{name}.jsonl", registry, "tool-set", halves=True)
       for name, registry in (("catalog", CATALOG_PATH), ("bfcl", BFCL_PATH),
                              ("tmdb", DATA_DIR / "restbench-tmdb" / "restbench-tmdb.json"),
                              ("spotify", DATA_DIR / "restbench-spotify" / "restbench-spotify.json"),
                              ("toolalpaca", DATA_DIR / "toolalpaca" / "toolalpaca.json"))},
    # requests no tool of the registry serves, near misses and unrelated, written by hand (eval/data/nofit/README.md)
    **{f"{name}-nofit": _Bundled(f"nofit/{name}.jsonl", registry, "near", halves=True)
       for name, registry in (("catalog", CATALOG_PATH), ("bfcl", BFCL_PATH),
                              ("tmdb", DATA_DIR / "restbench-tmdb" / "restbench-tmdb.json"),
                              ("spotify", DATA_DIR / "restbench-spotify" / "restbench-spotify.json"),
                              ("toolalpaca", DATA_DIR / "toolalpaca" / "toolalpaca.json"))},
    # requests of the same kind written to train on, never measured on (eval/data/situations/README.md)
    "catalog-situations": _Bundled("situations/catalog.jsonl", CATALOG_PATH, "tool-set", train_only=True),
}


def normalize(text: str) -> str:
    """The form two queries are compared in (for leaks and for the split order).

    >>> normalize("  What's the\\tweather  in PARIS? ")
    "what's the weather in paris?"
    """
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()


def text_hash(text: str) -> str:
    return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()


def is_bundled(name: str) -> bool:
    """Whether ``name`` is a bundled set (``BUNDLED``) or a composed one (``eval/composed.py``), not a file."""
    from tooltrie.eval.composed import is_composed

    return name in BUNDLED or is_composed(name)


def registry_path(name: str) -> Path:
    """The bundled registry whose tool names a bundled set's labels use."""
    from tooltrie.eval.composed import SOURCES, SUFFIX, is_composed

    return _bundled(SOURCES[name.removesuffix(SUFFIX)][0] if is_composed(name) else name).registry


def load_split(name: str, split: str) -> list[LabelledQuery]:
    """A bundled set's ``split`` ("train", "validation", "test"), or with ``split="all"`` every query.

    A path to a JSONL file is read whole (``split`` must be "all"): a user's own set is theirs to split.

    >>> len(load_split("metatool-single", "test")), len(load_split("metatool-multi", "test"))
    (470, 118)
    """
    from tooltrie.eval.composed import SUFFIX, composed_split, is_composed

    if is_composed(name):  # compound requests joined from the set's registry's single-tool ones (eval/composed.py)
        return list(composed_split(name.removesuffix(SUFFIX), split))
    if name not in BUNDLED:
        if split != "all":
            raise DatasetError(f"{name}: only a bundled set ({', '.join(BUNDLED)}) has splits; "
                               f"a JSONL file is read whole (split 'all'), asked for {split!r}")
        return load_queries(name)
    if split == "all":
        return list(_read_bundled(name))
    if split not in SPLITS:
        raise DatasetError(f"{name}: unknown split {split!r}; choose one of {', '.join((*SPLITS, 'all'))}")
    return list(_splits(name)[split])


def load_queries(path: str | Path) -> list[LabelledQuery]:
    """Read a JSONL file of ``{"query", "tools"[, "k"]}`` objects; blank lines are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such labelled query file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read it as UTF-8 text: {exc}") from None
    queries = [_parse_line(line, f"{path}:{number}") for number, line in enumerate(lines, 1) if line.strip()]
    if not queries:
        raise DatasetError(f"{path}: no labelled queries in it")
    return queries


def check_labels(queries: Iterable[LabelledQuery], registry: Registry) -> None:
    """Refuse a label the registry's trie cannot express: an unknown or repeated tool, or k outside 1..tools."""
    known = set(registry.names)
    for item in queries:
        where = item.where or repr(item.query[:40])
        for name in item.tools:
            if name not in known:
                close = difflib.get_close_matches(name, registry.names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise DatasetError(f"{where}: tool {name!r} is not in registry {registry.name!r}{hint}")
        repeated = sorted({name for name in item.tools if item.tools.count(name) > 1})
        if repeated:
            raise DatasetError(f"{where}: tool(s) {', '.join(repeated)} named more than once; an answer has "
                               "distinct tools")
        unknown_near = [name for name in item.near if name not in known]
        if unknown_near:
            raise DatasetError(f"{where}: near names {unknown_near}, not tools of registry {registry.name!r}")
        if item.kind == "none" and item.k == 0:
            continue
        if not 1 <= item.k <= len(registry):
            raise DatasetError(f"{where}: {item.k} tools; an answer has 1 to {len(registry)} (the registry's size)")


def held_out_hashes() -> frozenset[str]:
    """The normalized-text hashes of every bundled test query: never trained on."""
    return frozenset(item.text_hash for name in BUNDLED for item in _test(name))


def split_digest(queries: Sequence[LabelledQuery]) -> str:
    """A digest of a split's content (texts and labels, in order), pinned by a test."""
    digest = hashlib.sha256()
    for item in queries:
        digest.update(json.dumps([item.text_hash, list(item.tools)]).encode())
    return digest.hexdigest()


# --- internals -------------------------------------------------------------------------------------------------


def _bundled(name: str) -> _Bundled:
    if name not in BUNDLED:
        raise DatasetError(f"unknown bundled query set {name!r}; choose one of {', '.join(BUNDLED)}")
    return BUNDLED[name]


def _parse_line(line: str, where: str) -> LabelledQuery:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not JSON: {exc.msg}") from None
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected an object {{\"query\", \"tools\"}}, got {type(record).__name__}")
    query, tools = record.get("query"), record.get("tools")
    if not isinstance(query, str) or not query.strip():
        raise DatasetError(f"{where}: 'query' must be a non-empty string")
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise DatasetError(f"{where}: 'tools' must be a list of tool names")
    category, kind, near = record.get("category", ""), record.get("kind", ""), record.get("near", [])
    if not isinstance(kind, str):
        raise DatasetError(f"{where}: 'kind' must be a string (e.g. \"need\"), got {type(kind).__name__}")
    if not tools and kind != "none":
        raise DatasetError(f"{where}: 'tools' is empty; every labelled query needs at least one gold tool (a request "
                           "no tool serves says \"kind\": \"none\")")
    if tools and kind == "none":
        raise DatasetError(f"{where}: \"kind\": \"none\" (no tool serves it) but tools are given")
    if not isinstance(near, list) or not all(isinstance(t, str) for t in near):
        raise DatasetError(f"{where}: 'near' must be a list of tool names")
    k = record.get("k", len(tools))
    if k != len(tools):
        raise DatasetError(f"{where}: 'k' is {k!r} but {len(tools)} tools are given")
    return LabelledQuery(query=query, tools=tuple(tools), where=where,
                         category=category if isinstance(category, str) else "", kind=kind, near=tuple(near))


@functools.cache
def _read_bundled(name: str) -> tuple[LabelledQuery, ...]:
    spec = _bundled(name)
    return tuple(load_queries(DATA_DIR / spec.file))


def _strata(name: str) -> list[list[LabelledQuery]]:
    """The set's queries by stratum (strata in first-seen order), each ordered by text hash, then line."""
    spec = _bundled(name)
    groups: dict[object, list[tuple[str, int, LabelledQuery]]] = {}
    for line, item in enumerate(_read_bundled(name)):
        key: object = {"tool": item.tools, "tool-set": frozenset(item.tools), "category": item.category,
                       "near": bool(item.near)}[spec.stratum]
        groups.setdefault(key, []).append((item.text_hash, line, item))
    return [[item for _, _, item in sorted(group, key=lambda e: (e[0], e[1]))] for group in groups.values()]


def _halves(name: str) -> tuple[list[LabelledQuery], list[LabelledQuery]]:
    """(test, validation) of a set split in halves: the queries ordered by stratum (its sorted names: the order does
    not depend on the file's), then text hash, then line, taken in turn, test first."""
    ordered = sorted(_strata(name), key=lambda group: (sorted(group[0].tools), bool(group[0].near)))
    queries = [item for group in ordered for item in group]
    return queries[0::2], queries[1::2]


def _round_half_up(value: float) -> int:
    return int(value + 0.5)


@functools.cache
def _test(name: str) -> tuple[LabelledQuery, ...]:
    spec = _bundled(name)
    if spec.train_only:
        return ()
    if spec.halves:
        return tuple(_halves(name)[0])
    test: list[LabelledQuery] = []
    for group in _strata(name):
        count = spec.test_count or max(1, _round_half_up(len(group) * spec.test_fraction))
        test += group[:count]
    return tuple(test)


@functools.cache
def _splits(name: str) -> dict[str, tuple[LabelledQuery, ...]]:
    withheld = held_out_hashes()
    if _bundled(name).train_only:
        return {"train": tuple(item for item in _read_bundled(name) if item.text_hash not in withheld),
                "validation": (), "test": ()}
    if _bundled(name).halves:
        kept = tuple(item for item in _halves(name)[1] if item.text_hash not in withheld)
        return {"train": (), "validation": kept, "test": _test(name)}
    remaining = sorted(((item.text_hash, line, item) for line, item in enumerate(_read_bundled(name))
                        if item.text_hash not in withheld), key=lambda e: (e[0], e[1]))
    count = _round_half_up(len(remaining) * VALIDATION_FRACTION)
    validation = [item for _, _, item in remaining[:count]]
    seen = {item.text_hash for item in validation}
    train = [item for _, _, item in remaining[count:] if item.text_hash not in seen]
    return {"train": tuple(train), "validation": tuple(validation), "test": _test(name)}
