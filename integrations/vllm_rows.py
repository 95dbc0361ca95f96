"""vLLM's rows on tooltrie's batch state, without vLLM: the per-request arguments and the row bookkeeping both vLLM
adapters (``integrations/vllm.py``) share. Importable (and tested) where vLLM is not installed.

Nothing here imports ``tooltrie.kernels`` (and with it Numba and llvmlite) until rows are made: vLLM's CPU worker
unpickles its config, which imports the processor's module, then scans every loaded module to rebind its Triton
kernel overrides, and llvmlite's ffi wrappers break that scan. The kernels are imported where they are first used.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import math
import operator
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import numpy.typing as npt
import torch

from tooltrie.compiler.artifact import Artifact
from tooltrie.errors import ArtifactError

if TYPE_CHECKING:
    from tooltrie.kernels.batch import TrieBatch
    from tooltrie.lexical import LexicalIndex
    from tooltrie.ranker import FollowUp

EXTRA_ARGS_KEY = "tooltrie"
# The flat form, for callers that cannot nest: vLLM's OpenAI server passes ``vllm_xargs`` (str, int, float or lists of
# them, no dicts) into ``extra_args`` as they are.
FLAT_ARTIFACT_KEY = "tooltrie_artifact"
FLAT_K_KEY = "tooltrie_k"
FLAT_TOOLS_KEY = "tooltrie_tools"
FLAT_PRIOR_KEY = "tooltrie_prior"  # one float per tool, already weighted (``tooltrie.ranker.Prior.scores``)
FLAT_WEIGHT_KEY = "tooltrie_model_weight"  # the model's weight beside it (``Prior.model_weight``)
# How the prior follows the answer (``Prior.follow``, a ``tooltrie.ranker.FollowUp``): the request's text, and its
# four numbers [lexical_weight, later_weight, covered, chain_weight]; the processor rebuilds the follow-up from them,
# the prior sent, the lexical index and the chains of the artifact's registry.
FLAT_QUERY_KEY = "tooltrie_query"
FLAT_FOLLOW_KEY = "tooltrie_follow"
FLAT_KEYS = {FLAT_ARTIFACT_KEY: "artifact", FLAT_K_KEY: "k", FLAT_TOOLS_KEY: "tools", FLAT_PRIOR_KEY: "prior",
             FLAT_WEIGHT_KEY: "model_weight", FLAT_QUERY_KEY: "query", FLAT_FOLLOW_KEY: "follow"}
FLAT_PREFIX = "tooltrie_"  # any other key with it is a typo, refused rather than silently unconstrained

# The one directory vLLM's processor reads artifacts from, set where vLLM starts; a request names a file in it.
# Unset: the compile cache's ``vllm/`` (``$TOOLTRIE_CACHE_DIR/vllm``), where ``serve --vllm-url`` writes by default.
ROOT_ENV = "TOOLTRIE_ARTIFACT_ROOT"
# An artifact's name: one file name, no separator, not starting with a dot (so neither ``..`` nor a hidden file);
# 200 characters leave room under the 255 bytes most file systems allow.
ARTIFACT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
# Loaded artifacts kept by name (each a few MB at 10,000 tools), and how long a name that failed stays failed without
# another look at the file system (a client repeating a bad name costs a dict lookup).
LOADED_ARTIFACTS = 8
FAILED_TTL_S = 5.0
FAILED_NAMES = 1024


Follow = tuple[float, float, float, float]  # FollowUp's lexical_weight, later_weight, covered, chain_weight


@dataclass(frozen=True)
class RequestArgs:
    artifact: str  # the artifact's name in the root
    k: int
    thinking_budget: bool = False  # vLLM forces the end of its thinking: it writes into the logits after us
    tools: tuple[int, ...] | None = None  # the tools the answer may use (ascending ids); None: all
    prior: tuple[float, ...] | None = None  # the fused ranker's prior, one per tool (weighted); None: no ranker
    model_weight: float = 1.0  # the model's weight beside the prior
    query: str | None = None  # the request's text, which the prior that follows the answer reads; None: no follow-up
    follow: Follow | None = None  # how the prior follows the answer; None: it does not


def artifact_root() -> Path:
    """The directory artifacts are read from: ``$TOOLTRIE_ARTIFACT_ROOT``, else the compile cache's ``vllm/``."""
    configured = os.environ.get(ROOT_ENV)
    if configured:
        return Path(configured)
    from tooltrie.compiler.cache import default_cache_dir

    return default_cache_dir() / "vllm"


def request_args(artifact: str | os.PathLike[str], k: int, *, tools: Collection[int] | None = None,
                 prior: Sequence[float] | npt.ArrayLike | None = None, model_weight: float = 1.0,
                 follow: FollowUp | None = None, flat: bool = False) -> dict[str, Any]:
    """``SamplingParams.extra_args`` that ask for an answer of exactly ``k`` tools (of ``tools``, tool ids, if
    given) under an artifact, ranked by the fused ranker when ``prior`` (a float per tool, already weighted) is
    given, beside the model's scores weighted by ``model_weight``; with ``follow`` too (``Prior.follow``, a
    ``tooltrie.ranker.FollowUp`` of that prior), the prior follows the answer as in process: its request's text and
    its four numbers travel (``query``, ``follow``). ``flat``: as top-level keys, the form vLLM's OpenAI server can
    carry in a request's ``vllm_xargs``. ``artifact`` is a name in the processor's root (a string without a
    separator), or a file (a path), which is then copied there under its content's name (:func:`publish_artifact`)
    and named.

    >>> request_args("catalog.trie.safetensors", 2)
    {'tooltrie': {'artifact': 'catalog.trie.safetensors', 'k': 2}}
    >>> request_args("catalog.trie.safetensors", 2, tools=[7, 3, 5], flat=True)
    {'tooltrie_artifact': 'catalog.trie.safetensors', 'tooltrie_k': 2, 'tooltrie_tools': [3, 5, 7]}
    >>> from tooltrie.ranker import Ranker, Weights
    >>> from tooltrie.registry import make_registry
    >>> registry = make_registry([{"name": "get_weather"}, {"name": "get_news"}], name="d")
    >>> made = Ranker(registry, prior="lexical", fused=Weights(0.0, 1.0)).row("weather and news", "fused")
    >>> flat = request_args("d.trie.safetensors", 2, prior=made.scores, model_weight=made.model_weight,
    ...                     follow=made.follow, flat=True)
    >>> flat["tooltrie_query"], flat["tooltrie_follow"]
    ('weather and news', [1.0, 1.0, 0.5, 3.0])
    """
    name = artifact if isinstance(artifact, str) and os.sep not in artifact else publish_artifact(artifact)
    args: dict[str, Any] = {"artifact": name, "k": int(k)}
    if tools is not None:
        args["tools"] = sorted(int(tool) for tool in tools)
    if prior is not None:
        args["prior"], args["model_weight"] = encode_prior(prior), float(model_weight)
    if follow is not None:
        if prior is None:
            raise ValueError("request_args: 'follow' without 'prior' (the prior that follows the answer starts from "
                             "the request's prior, follow.first)")
        args["query"] = str(follow.query)
        args["follow"] = [float(follow.lexical_weight), float(follow.later_weight), float(follow.covered),
                          float(follow.chain_weight)]
    if flat:
        return {flat_key: args[key] for flat_key, key in FLAT_KEYS.items() if key in args}
    return {EXTRA_ARGS_KEY: args}


def publish_artifact(path: str | os.PathLike[str], *, root: Path | None = None) -> str:
    """The name, in ``root`` (default: :func:`artifact_root`), of the artifact file at ``path``: its own name if it
    is a file of the root, else a copy written there (atomically, once) named by its content."""
    root = artifact_root() if root is None else root
    real = Path(os.path.realpath(path))
    if real.parent == Path(os.path.realpath(root)) and ARTIFACT_NAME.fullmatch(real.name):
        return real.name
    stat = real.stat()
    return _published(str(real), str(root), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _published(path: str, root: str, inode: int, size: int, mtime_ns: int) -> str:
    blob = Path(path).read_bytes()
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", Path(path).name.split(".")[0])[:64] or "artifact"
    name = f"{stem}-{hashlib.sha256(blob).hexdigest()[:16]}.trie.safetensors"
    target = Path(root) / name
    if not target.is_file():
        from tooltrie.compiler.artifact import write_atomically

        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(target, blob)
    return name


def parse_request_args(params: Any) -> RequestArgs | None:
    """The request's tooltrie arguments, nested (``{"tooltrie": {"artifact", "k", "tools", ...}}``) or flat
    (``tooltrie_artifact``, ``tooltrie_k``, ``tooltrie_tools``, ...: ``FLAT_KEYS``), or None if it did not ask for
    the constraint; ``ValueError`` (which vLLM turns into a refused request) when they are malformed, name no
    artifact of the root or do not fit it."""
    extra = params.extra_args or {}
    flat_keys = sorted(key for key in extra if isinstance(key, str) and key.startswith(FLAT_PREFIX))
    flat_form = ", ".join(map(repr, FLAT_KEYS))
    if EXTRA_ARGS_KEY in extra:
        if flat_keys:
            raise ValueError(f"extra_args: give either {EXTRA_ARGS_KEY!r} or the flat keys ({flat_form}), not both "
                             f"(got {EXTRA_ARGS_KEY!r} and {', '.join(flat_keys)})")
        where, args = f"extra_args[{EXTRA_ARGS_KEY!r}]", extra[EXTRA_ARGS_KEY]
        form = ("{'artifact': name, 'k': int, 'tools': [int, ...] (optional), 'prior': [float, ...] and "
                "'model_weight': float (optional), 'query': str and 'follow': [float, float, float] (optional, with "
                "'prior')}")
        if not isinstance(args, dict) or set(args) - set(FLAT_KEYS.values()):
            raise ValueError(f"{where} must be {form}, got {_shown(args)}")
    elif flat_keys:
        unknown = [key for key in flat_keys if key not in FLAT_KEYS]
        if unknown:
            raise ValueError(f"extra_args: unknown key {unknown[0]!r} (the flat form is {flat_form})")
        where = "extra_args"
        form = (f"{{{FLAT_ARTIFACT_KEY!r}: name, {FLAT_K_KEY!r}: int, {FLAT_TOOLS_KEY!r}: [int, ...] (optional), "
                f"{FLAT_PRIOR_KEY!r}: [float, ...] and {FLAT_WEIGHT_KEY!r}: float (optional), {FLAT_QUERY_KEY!r}: str "
                f"and {FLAT_FOLLOW_KEY!r}: [float, float, float] (optional, with {FLAT_PRIOR_KEY!r})}}")
        args = {FLAT_KEYS[key]: extra[key] for key in flat_keys}
    else:
        return None
    artifact, k, tools = args.get("artifact"), args.get("k"), args.get("tools")
    if not isinstance(artifact, str) or type(k) is not int or not (
            tools is None or (isinstance(tools, list) and all(type(tool) is int for tool in tools))):
        raise ValueError(f"{where} must be {form}, got {_shown(args)}")
    from tooltrie.kernels.state import check_k, check_subset  # not at import: see the module's docstring

    loaded = load_artifact(artifact, where=where)
    check_k(k, loaded.trie.n_tools, where=where)
    subset = None
    if tools is not None:
        subset = tuple(sorted(set(tools)))
        if len(subset) != len(tools):
            raise ValueError(f"{where}: 'tools' names a tool more than once")
        check_subset(loaded, subset, k, where=f"{where}: tools")
    prior, model_weight = _ranker_args(args, loaded.trie.n_tools, where)
    query, follow = _follow_args(args, where)
    budgeted = getattr(params, "thinking_token_budget", None) is not None
    return RequestArgs(artifact=artifact, k=k, thinking_budget=budgeted, tools=subset, prior=prior,
                       model_weight=model_weight, query=query, follow=follow)


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _ranker_args(args: dict[str, Any], n_tools: int, where: str) -> tuple[tuple[float, ...] | None, float]:
    """The fused ranker's prior (a finite number per tool of the registry) and the model's weight (finite), or no
    prior and weight 1; a weight without a prior is refused (it would rank nothing)."""
    prior, weight = args.get("prior"), args.get("model_weight", 1.0)
    if prior is None:
        if "model_weight" in args:
            raise ValueError(f"{where}: 'model_weight' without 'prior' (the weight is the model's beside a prior)")
        return None, 1.0
    values = _prior_values(prior)
    if values is None or values.shape != (n_tools,) or not np.isfinite(values).all():
        raise ValueError(f"{where}: 'prior' must be {n_tools} finite numbers (one per tool of the registry; a list, "
                         f"or {PRIOR_PREFIX!r} and the base64 of their little-endian float32), got {_shown(prior)}")
    if not _number(weight):
        raise ValueError(f"{where}: 'model_weight' must be a finite number, got {_shown(weight)}")
    return tuple(values.tolist()), float(weight)


def _follow_args(args: dict[str, Any], where: str) -> tuple[str | None, Follow | None]:
    """How the prior follows the answer: the request's text (``query``) and ``follow``'s four finite numbers
    (``FollowUp``'s lexical_weight, later_weight, covered, chain_weight), or neither. Each needs the other, and both
    a prior (the follow-up starts from it); the ranker's own checks (``_ranker_args``) come first."""
    query, follow = args.get("query"), args.get("follow")
    if follow is None:
        if "query" in args:
            raise ValueError(f"{where}: 'query' without 'follow' (the request's text is read by the prior that "
                             "follows the answer)")
        return None, None
    if args.get("prior") is None:
        raise ValueError(f"{where}: 'follow' without 'prior' (the prior that follows the answer starts from the "
                         "request's prior)")
    if query is None:
        raise ValueError(f"{where}: 'follow' without 'query' (the prior that follows the answer reads the request's "
                         "text)")
    if not isinstance(query, str):
        raise ValueError(f"{where}: 'query' must be the request's text (a string), got {_shown(query)}")
    if not (isinstance(follow, list) and len(follow) == 4 and all(map(_number, follow))):
        raise ValueError(f"{where}: 'follow' must be four finite numbers [lexical_weight, later_weight, covered, "
                         f"chain_weight], got {_shown(follow)}")
    lexical_weight, later_weight, covered, chain_weight = (float(value) for value in follow)
    return query, (lexical_weight, later_weight, covered, chain_weight)


def follow_up(args: RequestArgs, artifact: Artifact) -> FollowUp | None:
    """The request's prior that follows its answer (``tooltrie.ranker.FollowUp``), made as in process from what the
    request sent (the prior, float32 as sent, its text and four numbers), the lexical index of ``artifact``'s
    registry (:meth:`ArtifactNames.lexical`, built as ``Ranker.lexical`` builds it) and its chains
    (``Chains.of``, as the ranker's); None when it sent none."""
    if args.follow is None or args.prior is None or args.query is None:
        return None
    from tooltrie.chains import Chains
    from tooltrie.ranker import FollowUp

    lexical_weight, later_weight, covered, chain_weight = args.follow
    index = ARTIFACTS.lexical(args.artifact, artifact)
    return FollowUp(np.asarray(args.prior, dtype=np.float32), args.query, index, artifact.registry.tools,
                    lexical_weight, later_weight, covered, Chains.of(artifact.registry), chain_weight)


PRIOR_PREFIX = "f32:"  # a prior as text: this, then the base64 of its little-endian float32 values


def encode_prior(prior: Sequence[float] | npt.ArrayLike) -> str:
    """A prior in the compact form ``request_args`` sends: a registry of 1,853 tools takes 10 kB of text (as a list
    of numbers, about 35 kB, which vLLM also copies and checks number by number).

    >>> encode_prior([0.5, -2.0])
    'f32:AAAAPwAAAMA='
    >>> _prior_values(encode_prior([0.5, -2.0])).tolist()
    [0.5, -2.0]
    """
    return PRIOR_PREFIX + base64.b64encode(np.asarray(prior, dtype="<f4").tobytes()).decode("ascii")


def _prior_values(prior: Any) -> npt.NDArray[np.float64] | None:
    """A request's prior as numbers: a list of them, or ``encode_prior``'s text; None when it is neither."""
    if isinstance(prior, str) and prior.startswith(PRIOR_PREFIX):
        try:
            raw = base64.b64decode(prior[len(PRIOR_PREFIX):], validate=True)
        except ValueError:
            return None
        return np.frombuffer(raw, dtype="<f4").astype(np.float64) if len(raw) % 4 == 0 else None
    if isinstance(prior, list) and all(type(value) in (int, float) for value in prior):
        return np.asarray(prior, dtype=np.float64)
    return None


def _shown(value: Any) -> str:
    """A client's value in an error, cut short."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


@dataclass(eq=False)
class _Loaded:
    """A loaded artifact of the root: the file's identity (inode, size, mtime) when it was read, its real path, and
    the lexical index of its registry once a request has asked for it (``ArtifactNames.lexical``)."""

    identity: tuple[int, int, int]
    artifact: Artifact
    path: str
    lexical: LexicalIndex | None = None


class ArtifactNames:
    """The artifacts of one root, by name: loaded on first use (the header checked before any array is read),
    the last ``LOADED_ARTIFACTS`` kept, a failed name remembered for ``FAILED_TTL_S``. What is refused never shows
    the file system: a name that is not a plain file name, that is not a file of the root, or that leads out of it
    (a link) is the same "unknown artifact name". A kept artifact keeps the lexical index of its registry beside it,
    made on the first request whose prior follows its answer (:meth:`lexical`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._indexing = threading.Lock()  # one lexical index built at a time, outside ``_lock``
        self._loaded: OrderedDict[tuple[str, str], _Loaded] = OrderedDict()
        self._failed: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()
        self.loads = 0  # files read, failed or not (tests count them)
        self.indexed = 0  # lexical indexes made, read from their file or built (tests count them)

    def load(self, name: str, *, root: Path | None = None, where: str = "request") -> Artifact:
        root_path = os.path.realpath(artifact_root() if root is None else root)
        key = (root_path, name)
        with self._lock:
            failed = self._failed.get(key)
            if failed is not None and failed[0] > time.monotonic():
                raise ValueError(f"{where}: {failed[1]}")
            try:
                path, identity = self._find(root_path, name)
            except ValueError as exc:
                self._fail(key, str(exc), where)
            kept = self._loaded.get(key)
            if kept is not None and kept.identity == identity:
                self._loaded.move_to_end(key)
                return kept.artifact
            self.loads += 1
            try:
                artifact = Artifact.load(path)
            except ArtifactError as exc:  # its message starts with the path: told by name instead
                reason = str(exc).removeprefix(f"{path}: ")
                self._fail(key, f"artifact {name!r} cannot be used: {reason}", where)
            self._loaded[key] = _Loaded(identity, artifact, path)
            self._failed.pop(key, None)
            while len(self._loaded) > LOADED_ARTIFACTS:
                self._loaded.popitem(last=False)
            return artifact

    def lexical(self, name: str, artifact: Artifact, *, root: Path | None = None) -> LexicalIndex:
        """The lexical index of ``artifact``'s registry (``artifact``: what :meth:`load` gave for ``name``), as the
        in-process ranker makes it (``Ranker.lexical``: ``LexicalIndex.cached`` with its default settings): read
        from its file beside the artifact in the root (``ranker.lexical_path``) when that holds this registry's, else
        built and written there (a root that cannot be written is logged, and the index still answers). Kept with
        the loaded artifact: made once per artifact loaded, on the first request that asks. An artifact no longer
        kept under ``name`` (dropped since, or the file replaced) gets its index made again, and not kept."""
        from tooltrie.lexical import LexicalIndex
        from tooltrie.ranker import lexical_path

        root_path = os.path.realpath(artifact_root() if root is None else root)
        key = (root_path, name)
        with self._lock:
            kept = self._loaded.get(key)
        entry = kept if kept is not None and kept.artifact is artifact else None
        if entry is not None and entry.lexical is not None:
            return entry.lexical
        with self._indexing:
            if entry is not None and entry.lexical is not None:  # made by another thread meanwhile
                return entry.lexical
            path = entry.path if entry is not None else os.path.join(root_path, name)
            index = LexicalIndex.cached(artifact.registry, lexical_path(path))
            self.indexed += 1
            if entry is not None:
                entry.lexical = index
            return index

    @staticmethod
    def _find(root: str, name: str) -> tuple[str, tuple[int, int, int]]:
        unknown = ValueError(f"unknown artifact name {_shown(name)} (a file name in the processor's artifact root, "
                             f"${ROOT_ENV})")
        if not ARTIFACT_NAME.fullmatch(name):
            raise unknown
        path = os.path.realpath(os.path.join(root, name))
        try:
            stat = os.stat(path)
        except OSError:
            raise unknown from None
        if os.path.dirname(path) != root or not S_ISREG(stat.st_mode):
            raise unknown
        return path, (stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def _fail(self, key: tuple[str, str], message: str, where: str) -> NoReturn:
        self._failed[key] = (time.monotonic() + FAILED_TTL_S, message)
        self._failed.move_to_end(key)
        while len(self._failed) > FAILED_NAMES:
            self._failed.popitem(last=False)
        raise ValueError(f"{where}: {message}")


ARTIFACTS = ArtifactNames()


def load_artifact(name: str, *, where: str = "request") -> Artifact:
    """The artifact named ``name`` in the root (:class:`ArtifactNames`); ``ValueError`` if there is none."""
    return ARTIFACTS.load(name, where=where)


# Async scheduling (vLLM on GPUs) appends this to a request's output list for a token sampled but not yet copied
# back to the host. With a custom logits processor vLLM writes the real id over it before the sampler runs the
# processors (V1 runner: ``InputBatch.update_async_output_token_ids`` in ``_sample``, since custom processors make it
# keep output ids): ``apply`` never sees one. If it does, the row's position is unknown: the placeholder is accepted
# as the token it is, one no grammar allows, and fails the row (only stop then) rather than masking for the previous
# position.
PLACEHOLDER = -1

# A CPU step either masks the constrained rows in place (writing -inf over every illegal logit) or returns a buffer
# that gets only their legal logits but every other row copied whole (``kernels.cpu.LegalLogits``). Measured on a
# shared 2-core AMD EPYC VM with a 49,152-token vocabulary: copying a plain row costs about what the buffer saves on
# 16 constrained rows, so the buffer is used only where plain rows are at most 1/16 of the constrained ones.
PLAIN_ROW_COST = 16
# Batch states kept for artifacts none of whose rows is live (the least recently used go first): a request for one of
# them again does not rebuild it. Each holds a copy of its artifact's counts (an int32 per edge) per row of capacity.
IDLE_ARTIFACT_STATES = 8


class ArtifactRows:
    """The rows of vLLM's batch that carry our arguments: one ``TrieBatch`` per artifact, whose rows keep vLLM's
    row numbers (V1 batch indices, V2 slots). ``fed[row]`` counts the output tokens the row has accepted (0 for rows
    that are not ours).

    A step visits only the artifacts that have rows (``live``: artifact name -> its number of rows); the states of
    artifacts left without rows are kept for the next request that names one (``idle``, least recently used first),
    at most ``IDLE_ARTIFACT_STATES`` of them: however many artifacts a long-running vLLM has served, it holds the
    states of its live ones and a few more."""

    def __init__(self, device: torch.device | str | None) -> None:
        from tooltrie.kernels.cpu import LegalLogits  # not at import: see the module's docstring

        self.backend = "cuda" if torch.device(device or "cpu").type == "cuda" else "cpu"
        self.batches: dict[str, TrieBatch] = {}
        self.args: dict[int, RequestArgs] = {}
        self.fed = np.zeros(16, dtype=np.int64)
        self.budgeted = np.zeros(16, dtype=bool)  # rows whose request has a thinking budget
        self.ranked = np.zeros(16, dtype=bool)  # rows whose request carries a prior (the fused ranker)
        # Which request holds each row (a number new for each request added; 0: none of ours), and which one each
        # row of the buffer last served: a row of the buffer is reset whole when it serves another request, so that
        # whatever a later stage wrote into it (a finite value in an illegal column) cannot reach the next request.
        self.serial = np.zeros(16, dtype=np.int64)
        self.served = np.zeros(0, dtype=np.int64)
        self.next_serial = 1
        self.legal = LegalLogits()  # on a CPU, what ``apply`` returns (see PLAIN_ROW_COST)
        # Per artifact, vLLM row -> its batch row (the same number; -1: not this artifact's), with one more entry,
        # -1, at the end, so that row -1 (NumPy's last entry) maps to -1: a step maps its rows with one gather.
        self.owners: dict[str, npt.NDArray[np.int32]] = {}
        self.live: dict[str, int] = {}
        self.idle: OrderedDict[str, None] = OrderedDict()
        self.visited = 0  # artifact states a step has visited, summed over steps (tests count them)

    def __contains__(self, row: int) -> bool:
        return row in self.args

    def add(self, row: int, args: RequestArgs) -> None:
        """A request joins in ``row`` (or starts over there: a preempted request recomputed); one whose prior follows
        its answer gets its ``FollowUp`` (:func:`follow_up`), which the batch calls at each tool boundary."""
        from tooltrie.kernels.batch import TrieBatch

        self.remove(row)
        name = args.artifact
        artifact = load_artifact(name)
        batch = self.batches.get(name)
        if batch is not None and batch.artifact is not artifact and not self.live.get(name):
            self._drop(name)  # the file under that name changed since: a state for the new one
            batch = None
        if batch is None:
            batch = self.batches[name] = TrieBatch(artifact, backend=self.backend, capacity=max(16, row + 1))
            self.owners[name] = np.full(len(self.fed) + 1, -1, dtype=np.int32)
            self.idle[name] = None  # until its first row is set (below), as any state without rows
        batch.add(row, args.k, subset=args.tools, prior=args.prior, model_weight=args.model_weight,
                  follow=follow_up(args, batch.artifact))
        self._set(row, args, 0, self.next_serial)
        self.next_serial += 1

    def remove(self, row: int) -> None:
        args = self.args.get(row)
        if args is not None:
            self.batches[args.artifact].remove(row)
        self._set(row, None, 0, 0)

    def move(self, source: int, target: int, *, swap: bool) -> None:
        """vLLM moved ``source``'s request to ``target`` (and, with ``swap``, ``target``'s to ``source``)."""
        if source == target:
            return
        moving, displaced = self._row(source), self._row(target)
        if swap and moving[0] is not None and displaced[0] is not None and (
                moving[0].artifact == displaced[0].artifact):
            self.batches[moving[0].artifact].swap(source, target)
        else:
            if displaced[0] is not None:  # first, so that a move within one batch is not undone
                batch = self.batches[displaced[0].artifact]
                batch.move(target, source) if swap else batch.remove(target)
            if moving[0] is not None:
                self.batches[moving[0].artifact].move(source, target)
        self._set(target, *moving)
        self._set(source, *(displaced if swap else (None, 0, 0)))

    def apply(self, logits: torch.Tensor, rows: Sequence[int] | npt.NDArray[np.integer],
              new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits row i belongs to vLLM row ``rows[i]`` (-1 or a row that is not ours: left alone) and brings it
        ``new_tokens[i]``: accept them, then mask, one call each per artifact, with no Python loop over rows. A row
        whose request carries a prior gets its options' fused values instead (``TrieBatch.fuse_logits_``): vLLM's
        greedy sampler then takes the fused ranker's choice.

        The masked logits are returned: on a GPU they are ``logits``, masked in place; on a CPU either ``logits``
        masked in place or a buffer that gets only the legal logits (``kernels.cpu.LegalLogits``), whichever costs
        less for the step's mix of rows (``PLAIN_ROW_COST``); in place, too, in a step with a thinking budget among
        its rows (vLLM writes finite values into the logits after us)."""
        from tooltrie.kernels.batch import ragged_ids
        from tooltrie.kernels.bitmask import get_bitmask_shape

        tokens, lengths = ragged_ids(new_tokens)
        vllm_rows = np.asarray(rows, dtype=np.int32).reshape(-1)
        self._grow(int(vllm_rows.max(initial=-1)) + 1)
        requests = np.where(vllm_rows >= 0, self.serial[vllm_rows], 0)
        constrained = requests > 0
        n_constrained = int(np.count_nonzero(constrained))
        if not n_constrained:
            return logits
        ranked = self.ranked[np.where(vllm_rows >= 0, vllm_rows, 0)] & constrained
        in_place = (self.backend != "cpu" or (len(vllm_rows) - n_constrained) * PLAIN_ROW_COST > n_constrained
                    or bool(self.budgeted[vllm_rows[constrained]].any()))
        bitmask = None if in_place else np.empty(get_bitmask_shape(*logits.shape), dtype=np.int32)
        fused: list[tuple[str, npt.NDArray[np.int32]]] = []  # artifacts with ranked rows, for the buffer
        for name in self.live:
            self.visited += 1
            mine = self.owners[name][vllm_rows]  # -1 stays -1: an owner table ends with -1
            ours = mine >= 0
            if ours.any():
                self.fed[mine[ours]] += lengths[ours]
                self.batches[name].accept(tokens, mine, lengths=lengths)
                if bitmask is None and ranked[ours].any():  # the fused values: vLLM's argmax takes the choice
                    self.batches[name].fuse_logits_(logits, mine)
                elif bitmask is None:
                    self.batches[name].mask_logits_(logits, mine)
                else:
                    self.batches[name].fill_bitmask(bitmask, mine)
                    if ranked[ours].any():
                        fused.append((name, mine))
        if bitmask is None:
            return logits
        if len(self.served) < len(requests):
            self.served = np.concatenate([self.served, np.zeros(len(requests) - len(self.served), np.int64)])
        changed = np.flatnonzero(self.served[: len(requests)] != requests)
        self.legal.reset(changed)
        self.served[changed] = requests[changed]
        masked: torch.Tensor = self.legal(logits, bitmask, constrained)
        for name, mine in fused:  # the buffer holds only the legal logits: their fused values over them
            self.batches[name].fuse_legal_(masked, mine)
        return masked

    def unfed(self, outputs: Sequence[Sequence[int]]) -> list[Sequence[int]]:
        """Row i's output tokens past those it has accepted, from its whole output list ``outputs[i]`` (a
        ``PLACEHOLDER`` among them fails the row: see there)."""
        self._grow(len(outputs))
        starts = self.fed[: len(outputs)].tolist()
        return list(map(operator.getitem, outputs, map(slice, starts, itertools.repeat(None))))

    def _row(self, row: int) -> tuple[RequestArgs | None, int, int]:
        if row >= len(self.fed):
            return None, 0, 0
        return self.args.get(row), int(self.fed[row]), int(self.serial[row])

    def _set(self, row: int, args: RequestArgs | None, fed: int, serial: int) -> None:
        """Row ``row`` holds request ``serial`` (``args``' request; None and 0: none of ours), which has accepted
        ``fed`` tokens."""
        before = self.args.pop(row, None)
        if args is not None:
            self.args[row] = args
        self._grow(row + 1)
        self.fed[row] = fed
        self.serial[row] = serial
        self.budgeted[row] = args is not None and args.thinking_budget
        self.ranked[row] = args is not None and args.prior is not None
        if before is not None:
            self.owners[before.artifact][row] = -1
            self._count(before.artifact, -1)
        if args is not None:
            self.owners[args.artifact][row] = row
            self._count(args.artifact, +1)

    def _count(self, name: str, change: int) -> None:
        """``name`` has ``change`` more rows: live while it has any, else idle (the oldest idle dropped)."""
        rows = self.live.pop(name, 0) + change
        if rows > 0:
            self.live[name] = rows
            self.idle.pop(name, None)
            return
        self.idle[name] = None
        while len(self.idle) > IDLE_ARTIFACT_STATES:
            self._drop(next(iter(self.idle)))

    def _drop(self, name: str) -> None:
        self.idle.pop(name, None)
        del self.batches[name], self.owners[name]

    def _grow(self, size: int) -> None:
        if size > len(self.fed):
            extra = max(size, 2 * len(self.fed)) - len(self.fed)
            self.fed = np.concatenate([self.fed, np.zeros(extra, np.int64)])
            self.serial = np.concatenate([self.serial, np.zeros(extra, np.int64)])
            self.budgeted = np.concatenate([self.budgeted, np.zeros(extra, bool)])
            self.ranked = np.concatenate([self.ranked, np.zeros(extra, bool)])
            for name, owner in self.owners.items():
                self.owners[name] = np.concatenate([owner, np.full(extra, -1, np.int32)])
