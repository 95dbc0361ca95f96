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

from tooltrie.asks import MAX_ASKS
from tooltrie.compiler.artifact import Artifact
from tooltrie.errors import ArtifactError

if TYPE_CHECKING:
    from tooltrie.kernels.batch import TrieBatch
    from tooltrie.lexical import LexicalIndex
    from tooltrie.ranker import FollowUp, PerAsk

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
# A request that asks several things (``Prior.follow`` a ``tooltrie.ranker.PerAsk``): each ask's prior, in the prior's
# form; ``tooltrie_prior`` is then the whole request's, which the answer follows once every ask has its tool.
FLAT_ASKS_KEY = "tooltrie_asks"
# The version of the follow-up's arithmetic and lexical settings the sender made the prior with
# (``tooltrie.ranker.follow_version``): the processor subtracts its own lexical z-scores from the prior it was sent, so
# both sides must score alike; a request made under other settings is refused, never silently followed differently.
FLAT_FOLLOW_VERSION_KEY = "tooltrie_follow_version"
# The artifact's sha256 (``Artifact.sha256``): sent by a client to pin the file it means, and written by validation
# (``validate_request``) so that the engine step adds exactly the artifact that was validated.
FLAT_SHA256_KEY = "tooltrie_sha256"
FLAT_KEYS = {FLAT_ARTIFACT_KEY: "artifact", FLAT_K_KEY: "k", FLAT_TOOLS_KEY: "tools", FLAT_PRIOR_KEY: "prior",
             FLAT_WEIGHT_KEY: "model_weight", FLAT_QUERY_KEY: "query", FLAT_FOLLOW_KEY: "follow",
             FLAT_FOLLOW_VERSION_KEY: "follow_version", FLAT_ASKS_KEY: "asks", FLAT_SHA256_KEY: "sha256"}
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


@dataclass(frozen=True)
class RowLimits:
    """What one request may ask of the processor, checked before any of its arguments is decoded or stored: a
    request beyond a limit is refused at admission (vLLM answers 400), so no engine step ever sees it."""

    max_k: int = 64
    """Tools in one answer. Cost: while the request lives, every row of its artifact's state carries a used-tool
    column per tool (``BatchState``), and the answer takes ``k`` times the longest name's tokens."""

    max_query_chars: int = 2_000
    """Characters of the request's text (``query``), which the follow-up scores at each tool: the endpoint's own
    bound (``ServeLimits.max_query_chars``)."""

    max_asks: int = MAX_ASKS
    """Asks of one request, each a prior of the registry's size (``asks``): the most the splitter makes."""

    max_magnitude: float = 1e6
    """The largest magnitude of a prior value, the model's weight and the follow-up's numbers: a fused value is a
    weighted logit plus a prior, and the follow-up sums a few weighted z-scores (each under 100 in magnitude), so
    with these bounds every float32 sum stays finite (a prior of 1e39 would overflow float32 at the step).
    Retrieval-weighted priors are at most a few thousand."""


LIMITS = RowLimits()


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
    asks: tuple[tuple[float, ...], ...] | None = None  # each ask's prior (weighted); None: the request asks one thing
    sha256: str | None = None  # the artifact's sha256 as validated: the step adds that file or fails the row


def artifact_root() -> Path:
    """The directory artifacts are read from: ``$TOOLTRIE_ARTIFACT_ROOT``, else the compile cache's ``vllm/``."""
    configured = os.environ.get(ROOT_ENV)
    if configured:
        return Path(configured)
    from tooltrie.compiler.cache import default_cache_dir

    return default_cache_dir() / "vllm"


def request_args(artifact: str | os.PathLike[str], k: int, *, tools: Collection[int] | None = None,
                 prior: Sequence[float] | npt.ArrayLike | None = None, model_weight: float = 1.0,
                 follow: FollowUp | PerAsk | None = None, sha256: str | None = None,
                 flat: bool = False) -> dict[str, Any]:
    """``SamplingParams.extra_args`` that ask for an answer of exactly ``k`` tools (of ``tools``, tool ids, if
    given) under an artifact, ranked by the fused ranker when ``prior`` (a float per tool, already weighted) is
    given, beside the model's scores weighted by ``model_weight``; with ``follow`` too (``Prior.follow``, a
    ``tooltrie.ranker.FollowUp`` of that prior), the prior follows the answer as in process: its request's text and
    its four numbers travel (``query``, ``follow``), with the version of the follow-up's settings
    (``follow_version``: the processor refuses another); a ``PerAsk`` follow (a request that asks several things)
    sends each ask's prior (``asks``) and, as ``prior``, the whole request's (``PerAsk.whole``), from which the
    processor makes the same prior of each tool. ``sha256``: the artifact's (``Artifact.sha256``), which
    pins the file: a request for a name that now holds another artifact is refused. ``flat``: as top-level keys,
    the form vLLM's OpenAI server can carry in a request's ``vllm_xargs``. ``artifact`` is a name in the
    processor's root (a string without a separator), or a file (a path), which is then copied there under its
    content's name (:func:`publish_artifact`) and named.

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
    if follow is not None and prior is None:
        raise ValueError("request_args: 'follow' without 'prior' (the prior that follows the answer starts from "
                         "the request's prior)")
    if prior is not None:
        args["prior"], args["model_weight"] = encode_prior(prior), float(model_weight)
    from tooltrie.ranker import PerAsk, follow_version

    if isinstance(follow, PerAsk):
        args["prior"], args["asks"] = encode_prior(follow.whole), [encode_prior(ask) for ask in follow.asks]
        follow = follow.then
    if follow is not None:
        args["query"] = str(follow.query)
        args["follow"] = [float(follow.lexical_weight), float(follow.later_weight), float(follow.covered),
                          float(follow.chain_weight)]
        args["follow_version"] = follow_version()
    if sha256 is not None:
        args["sha256"] = str(sha256)
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


@dataclass(frozen=True)
class ServedModel:
    """The model vLLM serves, as far as an artifact must fit it: its tokenizer's fingerprint (None: unknown, its
    tokenizer is not one tooltrie reads), the width of its logits, and its stop token (what a failed row is ended
    with)."""

    fingerprint: str | None
    vocab_size: int
    stop_id: int | None = None

    def misfit(self, artifact: Artifact) -> str | None:
        """Why ``artifact`` cannot decode for this model, or None when it can."""
        if self.fingerprint is not None and artifact.tokenizer_fingerprint != self.fingerprint:
            return (f"was compiled for another tokenizer (fingerprint {artifact.tokenizer_fingerprint[:16]}...) than "
                    f"the served model's ({self.fingerprint[:16]}...)")
        if artifact.max_token_id >= self.vocab_size:
            return (f"uses token id {artifact.max_token_id}, beyond the served model's vocabulary of "
                    f"{self.vocab_size}")
        return None

    @classmethod
    def of(cls, vllm_config: Any) -> ServedModel | None:
        """The served model of a vLLM config (None when it tells too little): the logits' width from its model
        config, the fingerprint and stop token from its tokenizer, read as ``TokenizerInfo`` reads one."""
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None:
            return None
        from tooltrie.compiler.tokenizer_info import TokenizerInfo

        try:
            info = TokenizerInfo.load(model_config.tokenizer)
        except Exception:  # a tokenizer tooltrie does not read: the vocabulary's size is still checked
            return cls(None, int(model_config.get_vocab_size()))
        return cls(info.fingerprint, int(model_config.get_vocab_size()), info.eos_id)


# Where the processor records the served model for admission. vLLM checks a request's arguments
# (``validate_params``) in its front-end process, which is handed no config; the processor, made in the engine's
# process with the config, writes the served model into the root once per process of its ancestry (the front end is
# one of them), and admission reads the record of its own process id.
SERVED_DIR = ".served"
SERVED_ANCESTRY = 3  # the engine process, its parent and grandparent: vLLM's front end is one of them


def record_served(served: ServedModel, *, root: Path | None = None) -> None:
    """Record ``served`` for the front end's admission checks (:func:`check_served`); a root that cannot be written
    leaves them to the engine's own check (the row fails instead of being refused)."""
    import json
    import logging

    from tooltrie.compiler.artifact import write_atomically

    folder = (artifact_root() if root is None else root) / SERVED_DIR
    blob = json.dumps({"fingerprint": served.fingerprint, "vocab_size": served.vocab_size,
                       "stop_id": served.stop_id}).encode()
    pid = os.getpid()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for _ in range(SERVED_ANCESTRY):
            if pid <= 1:
                break
            write_atomically(folder / f"{pid}.json", blob)
            pid = _parent(pid)
    except OSError as exc:
        logging.getLogger(__name__).warning("cannot record the served model in %s (%s): admission will not check "
                                            "artifacts' tokenizers; the engine still does", folder, exc)


def _parent(pid: int) -> int:
    if pid == os.getpid():
        return os.getppid()
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def served_model(*, root: Path | None = None) -> ServedModel | None:
    """The served model as the engine recorded it for this process (:func:`record_served`), or None; the record is
    read again only when its file changes (a stat per request)."""
    path = (artifact_root() if root is None else root) / SERVED_DIR / f"{os.getpid()}.json"
    try:
        stat = path.stat()
    except OSError:
        return None
    return _read_served(str(path), stat.st_ino, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_served(path: str, inode: int, mtime_ns: int) -> ServedModel | None:
    import json

    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        return ServedModel(record["fingerprint"], int(record["vocab_size"]), record["stop_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_served(artifact: Artifact, *, where: str = "request", served: ServedModel | None = None) -> None:
    """Refuse an artifact that does not fit the served model (``served``; None: as recorded for this process)."""
    served = served_model() if served is None else served
    misfit = None if served is None else served.misfit(artifact)
    if misfit is not None:
        raise ValueError(f"{where}: the artifact {misfit}")


def parse_request_args(params: Any, *, limits: RowLimits = LIMITS) -> RequestArgs | None:
    """The request's tooltrie arguments, nested (``{"tooltrie": {"artifact", "k", "tools", ...}}``) or flat
    (``tooltrie_artifact``, ``tooltrie_k``, ``tooltrie_tools``, ...: ``FLAT_KEYS``), or None if it did not ask for
    the constraint; ``ValueError`` (which vLLM turns into a refused request) when they are malformed, name no
    artifact of the root, do not fit it or pass a limit (``RowLimits``). Every bound is checked before the value it
    bounds is decoded or copied (a prior's text by its length, a list by its size). Whatever the engine step will do
    with the arguments is checked here: numbers whose float32 sums stay finite, the follow-up's version, the
    artifact's tokenizer against the served model's (when the served model is known: :func:`served_model`); the
    artifact's lexical index is made or read here too, not in the step."""
    extra = params.extra_args or {}
    flat_keys = sorted(key for key in extra if isinstance(key, str) and key.startswith(FLAT_PREFIX))
    flat_form = ", ".join(map(repr, FLAT_KEYS))
    if EXTRA_ARGS_KEY in extra:
        if flat_keys:
            raise ValueError(f"extra_args: give either {EXTRA_ARGS_KEY!r} or the flat keys ({flat_form}), not both "
                             f"(got {EXTRA_ARGS_KEY!r} and {', '.join(flat_keys)})")
        where, args = f"extra_args[{EXTRA_ARGS_KEY!r}]", extra[EXTRA_ARGS_KEY]
        form = ("{'artifact': name, 'k': int, 'tools': [int, ...] (optional), 'prior': [float, ...] and "
                "'model_weight': float (optional), 'query': str, 'follow': [float, float, float, float] and "
                "'follow_version': str (optional, with 'prior'), 'asks': [prior, ...] (optional, with 'prior'), "
                "'sha256': str (optional)}")
        if not isinstance(args, dict) or set(args) - set(FLAT_KEYS.values()):
            raise ValueError(f"{where} must be {form}, got {_shown(args)}")
    elif flat_keys:
        unknown = [key for key in flat_keys if key not in FLAT_KEYS]
        if unknown:
            raise ValueError(f"extra_args: unknown key {_shown(unknown[0])} (the flat form is {flat_form})")
        where = "extra_args"
        form = (f"{{{FLAT_ARTIFACT_KEY!r}: name, {FLAT_K_KEY!r}: int, {FLAT_TOOLS_KEY!r}: [int, ...] (optional), "
                f"{FLAT_PRIOR_KEY!r}: [float, ...] and {FLAT_WEIGHT_KEY!r}: float (optional), {FLAT_QUERY_KEY!r}: str, "
                f"{FLAT_FOLLOW_KEY!r}: [float, float, float, float] and {FLAT_FOLLOW_VERSION_KEY!r}: str (optional, "
                f"with {FLAT_PRIOR_KEY!r}), {FLAT_ASKS_KEY!r}: [prior, ...] (optional, with {FLAT_PRIOR_KEY!r}), "
                f"{FLAT_SHA256_KEY!r}: str (optional)}}")
        args = {FLAT_KEYS[key]: extra[key] for key in flat_keys}
    else:
        return None
    artifact, k, tools, sha256 = args.get("artifact"), args.get("k"), args.get("tools"), args.get("sha256")
    if not isinstance(artifact, str) or type(k) is not int or not (tools is None or isinstance(tools, list)) or not (
            sha256 is None or isinstance(sha256, str)):
        raise ValueError(f"{where} must be {form}, got {_shown(args)}")
    from tooltrie.kernels.state import check_k, check_subset  # not at import: see the module's docstring

    loaded = load_artifact(artifact, where=where)
    n_tools = loaded.trie.n_tools
    if sha256 is not None and sha256 != loaded.sha256:
        raise ValueError(f"{where}: artifact {artifact!r} is not the one asked for (its sha256 is "
                         f"{loaded.sha256[:16]}..., the request's {_shown(sha256)[:24]})")
    check_served(loaded, where=where)
    check_k(k, n_tools, where=where)
    if k > limits.max_k:
        raise ValueError(f"{where}: k={k} is more than {limits.max_k}, the most tools one answer may ask for here")
    subset = None
    if tools is not None:
        if len(tools) > n_tools or not all(type(tool) is int for tool in tools):
            raise ValueError(f"{where}: 'tools' must be at most {n_tools} tool ids (ints), got {_shown(tools)}")
        subset = tuple(sorted(set(tools)))
        if len(subset) != len(tools):
            raise ValueError(f"{where}: 'tools' names a tool more than once")
        check_subset(loaded, subset, k, where=f"{where}: tools")
    prior, model_weight = _ranker_args(args, n_tools, where, limits)
    query, follow = _follow_args(args, where, limits)
    asks = _asks_args(args, n_tools, where, limits)
    if follow is not None:
        ARTIFACTS.lexical(artifact, loaded)  # made (or read) now, not in the engine step
    budgeted = getattr(params, "thinking_token_budget", None) is not None
    return RequestArgs(artifact=artifact, k=k, thinking_budget=budgeted, tools=subset, prior=prior,
                       model_weight=model_weight, query=query, follow=follow, asks=asks, sha256=loaded.sha256)


def validate_request(params: Any) -> None:
    """vLLM's admission check (``validate_params``): :func:`parse_request_args`, then the validated artifact's sha256
    written into the request's arguments (``FLAT_SHA256_KEY``, or ``sha256`` in the nested form), which vLLM hands
    to the engine with them: the step adds the artifact that was validated, or fails the row, even if the file under
    that name is replaced in between."""
    args = parse_request_args(params)
    if args is None:
        return
    extra = params.extra_args
    if EXTRA_ARGS_KEY in extra:
        extra[EXTRA_ARGS_KEY] = {**extra[EXTRA_ARGS_KEY], "sha256": args.sha256}
    else:
        extra[FLAT_SHA256_KEY] = args.sha256


def _number(value: Any, limits: RowLimits) -> bool:
    return type(value) in (int, float) and abs(value) <= limits.max_magnitude


def _ranker_args(args: dict[str, Any], n_tools: int, where: str,
                 limits: RowLimits) -> tuple[tuple[float, ...] | None, float]:
    """The fused ranker's prior (a number of magnitude at most ``max_magnitude`` per tool of the registry) and the
    model's weight (the same bound), or no prior and weight 1; a weight without a prior is refused (it would rank
    nothing)."""
    prior, weight = args.get("prior"), args.get("model_weight", 1.0)
    if prior is None:
        if "model_weight" in args:
            raise ValueError(f"{where}: 'model_weight' without 'prior' (the weight is the model's beside a prior)")
        return None, 1.0
    values = _checked_prior(prior, n_tools, f"{where}: 'prior'", limits)
    if not _number(weight, limits):
        raise ValueError(f"{where}: 'model_weight' must be a finite number of magnitude at most "
                         f"{limits.max_magnitude:g}, got {_shown(weight)}")
    return tuple(values.tolist()), float(weight)


def _checked_prior(prior: Any, n_tools: int, where: str, limits: RowLimits) -> npt.NDArray[np.float64]:
    """One prior's values: a number of magnitude at most ``max_magnitude`` per tool of the registry."""
    values = _prior_values(prior, n_tools)
    if values is None or values.shape != (n_tools,) or not (np.abs(values) <= limits.max_magnitude).all():
        raise ValueError(f"{where} must be {n_tools} finite numbers of magnitude at most {limits.max_magnitude:g} "
                         f"(one per tool of the registry; a list, or {PRIOR_PREFIX!r} and the base64 of their "
                         f"little-endian float32), got {_shown(prior)}")
    return values


def _asks_args(args: dict[str, Any], n_tools: int, where: str,
               limits: RowLimits) -> tuple[tuple[float, ...], ...] | None:
    """Each ask's prior (``asks``: 2 to ``max_asks`` of them, each in the prior's form), or None; with a prior, the
    whole request's (checked first, by ``_ranker_args``)."""
    asks = args.get("asks")
    if asks is None:
        return None
    if args.get("prior") is None:
        raise ValueError(f"{where}: 'asks' without 'prior' (the whole request's prior, which the answer follows once "
                         "every ask has its tool)")
    if not isinstance(asks, list) or not 2 <= len(asks) <= limits.max_asks:
        raise ValueError(f"{where}: 'asks' must be a list of 2 to {limits.max_asks} priors (one per ask of the "
                         f"request), got {_shown(asks)}")
    return tuple(tuple(_checked_prior(ask, n_tools, f"{where}: 'asks'[{i}]", limits).tolist())
                 for i, ask in enumerate(asks))


def _follow_args(args: dict[str, Any], where: str, limits: RowLimits) -> tuple[str | None, Follow | None]:
    """How the prior follows the answer: the request's text (``query``, at most ``max_query_chars``), ``follow``'s
    four numbers (``FollowUp``'s lexical_weight, later_weight, covered, chain_weight, each of magnitude at most
    ``max_magnitude``) and the version of the settings they were made under (``follow_version``, which must be this
    side's), or none of them. Each needs the others, and all a prior (the follow-up starts from it); the ranker's
    own checks (``_ranker_args``) come first."""
    query, follow, version = args.get("query"), args.get("follow"), args.get("follow_version")
    if follow is None:
        for key in ("query", "follow_version"):
            if key in args:
                raise ValueError(f"{where}: {key!r} without 'follow' (they describe the prior that follows the "
                                 "answer)")
        return None, None
    if args.get("prior") is None:
        raise ValueError(f"{where}: 'follow' without 'prior' (the prior that follows the answer starts from the "
                         "request's prior)")
    if query is None:
        raise ValueError(f"{where}: 'follow' without 'query' (the prior that follows the answer reads the request's "
                         "text)")
    if not isinstance(query, str) or len(query) > limits.max_query_chars:
        raise ValueError(f"{where}: 'query' must be the request's text (a string), at most "
                         f"{limits.max_query_chars} characters, got {_shown(query)}")
    if not (isinstance(follow, list) and len(follow) == 4 and all(_number(value, limits) for value in follow)):
        raise ValueError(f"{where}: 'follow' must be four finite numbers of magnitude at most "
                         f"{limits.max_magnitude:g} "
                         f"[lexical_weight, later_weight, covered, chain_weight], got {_shown(follow)}")
    from tooltrie.ranker import follow_version

    if version != follow_version():
        raise ValueError(f"{where}: 'follow_version' {_shown(version)} is not this processor's ({follow_version()}): "
                         "the prior was made under other follow-up or lexical settings (another tooltrie version); "
                         "update one side")
    lexical_weight, later_weight, covered, chain_weight = (float(value) for value in follow)
    return query, (lexical_weight, later_weight, covered, chain_weight)


def follow_up(args: RequestArgs, artifact: Artifact) -> FollowUp | PerAsk | None:
    """The request's prior that follows its answer, made as in process from what the request sent: its asks'
    priors (``tooltrie.ranker.PerAsk``), then the whole request's (``FollowUp``: the prior, float32 as sent, its text
    and four numbers, the lexical index of ``artifact``'s registry (:meth:`ArtifactNames.lexical`, built as
    ``Ranker.lexical`` builds it) and its chains (``Chains.of``, as the ranker's)); None when it sent none."""
    from tooltrie.ranker import FollowUp, PerAsk

    then = None
    if args.follow is not None and args.prior is not None and args.query is not None:
        from tooltrie.chains import Chains

        lexical_weight, later_weight, covered, chain_weight = args.follow
        index = ARTIFACTS.lexical(args.artifact, artifact)
        then = FollowUp(np.asarray(args.prior, dtype=np.float32), args.query, index, artifact.registry.tools,
                        lexical_weight, later_weight, covered, Chains.of(artifact.registry), chain_weight)
    if args.asks is None or args.prior is None:
        return then
    return PerAsk(np.asarray(args.asks, dtype=np.float32), np.asarray(args.prior, dtype=np.float32), then)


def ranked(args: RequestArgs, artifact: Artifact) -> tuple[npt.ArrayLike | None, FollowUp | PerAsk | None]:
    """The prior a request's row starts from and how it follows the answer (``TrieBatch.add(prior=, follow=)``):
    a request of several asks starts from its asks' (``PerAsk``), others from the prior they sent."""
    follow = follow_up(args, artifact)
    return (args.prior if follow is None else follow(())), follow


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


def _prior_values(prior: Any, n_tools: int | None = None) -> npt.NDArray[np.float64] | None:
    """A request's prior as numbers: a list of them, or ``encode_prior``'s text; None when it is neither, or (with
    ``n_tools``) when its size is not one number per tool, told from the text's length or the list's before
    anything is decoded. A number too large for a float is inf (refused by the caller's bound)."""
    if isinstance(prior, str) and prior.startswith(PRIOR_PREFIX):
        encoded = prior[len(PRIOR_PREFIX):]
        if n_tools is not None and len(encoded) != 4 * math.ceil(4 * n_tools / 3):
            return None
        try:
            raw = base64.b64decode(encoded, validate=True)
        except ValueError:
            return None
        return np.frombuffer(raw, dtype="<f4").astype(np.float64) if len(raw) % 4 == 0 else None
    if isinstance(prior, list) and (n_tools is None or len(prior) == n_tools) and all(
            type(value) in (int, float) for value in prior):
        return np.array([value if type(value) is float or abs(value) < 2**63 else math.inf for value in prior],
                        dtype=np.float64)
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
            except ArtifactError as exc:  # refused as any name that is no artifact; why, in the log only
                import logging

                logging.getLogger(__name__).warning("artifact root: %s is not a loadable artifact: %s", name, exc)
                self._fail(key, _unknown(name), where)
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
        unknown = ValueError(_unknown(name))
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


def _unknown(name: str) -> str:
    return f"unknown artifact name {_shown(name)} (a file name in the processor's artifact root, ${ROOT_ENV})"


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

    def __init__(self, device: torch.device | str | None, model: ServedModel | None = None) -> None:
        from tooltrie.kernels.cpu import LegalLogits  # not at import: see the module's docstring

        self.model = model  # the served model, which every artifact must fit (None: unknown)
        # Rows whose request could not be added (its artifact changed or vanished since admission, or does not fit
        # the served model): row -> the stop token it is ended with, its only legal token (fail loudly, alone).
        self.failed: dict[int, int] = {}

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
        return row in self.args or row in self.failed

    def admit(self, row: int, params: Any) -> bool:
        """The request of sampling ``params`` joins in ``row`` if it asks for the constraint (True), else the row is
        left alone (False). Never raises: a request that cannot be added (its arguments read again here, in the
        engine's process, no longer hold: the file under its name changed or vanished since admission) fails in
        its row, which then allows only the stop token, and the other rows go on."""
        try:
            args = parse_request_args(params)
        except Exception as exc:
            self._fail_row(row, None, exc)
            return True
        if args is None:
            self.remove(row)
            return False
        self.add(row, args)
        return True

    def add(self, row: int, args: RequestArgs) -> None:
        """A request joins in ``row`` (or starts over there: a preempted request recomputed); one whose prior follows
        its answer gets its ``FollowUp`` (:func:`follow_up`), which the batch calls at each tool boundary. A request
        whose artifact is no longer the one validated (``args.sha256``), or does not fit the served model, fails in
        its row (never raises for one request)."""
        self.remove(row)
        artifact = None
        try:
            artifact = load_artifact(args.artifact)
            if args.sha256 is not None and artifact.sha256 != args.sha256:
                raise ValueError(f"artifact {args.artifact!r} changed since the request was validated")
            if self.model is not None:
                check_served(artifact, where=f"artifact {args.artifact!r}", served=self.model)
            self._add(row, args, artifact)
        except Exception as exc:  # the request's alone: its row fails, the step goes on
            self._fail_row(row, artifact, exc)

    def _fail_row(self, row: int, artifact: Artifact | None, exc: Exception) -> None:
        """``row`` ends with its stop token (the artifact's, else the served model's), whatever it is fed."""
        import logging

        self.remove(row)
        stop = artifact.eos_id if artifact is not None else None
        if stop is None or (self.model is not None and stop >= self.model.vocab_size):
            stop = self.model.stop_id if self.model is not None else None
        self.failed[row] = -1 if stop is None else stop
        logging.getLogger(__name__).warning("row %d fails at admission to the engine: %s", row, exc)

    def _add(self, row: int, args: RequestArgs, artifact: Artifact) -> None:
        from tooltrie.kernels.batch import TrieBatch

        name = args.artifact
        batch = self.batches.get(name)
        if batch is not None and batch.artifact.sha256 != artifact.sha256:
            if self.live.get(name):  # never a row on a state made for another file: it fails instead
                raise ValueError(f"artifact {name!r} was replaced while requests of the previous one decode")
            self._drop(name)  # the file under that name changed since: a state for the new one
            batch = None
        if batch is None:
            batch = self.batches[name] = TrieBatch(artifact, backend=self.backend, capacity=max(16, row + 1))
            self.owners[name] = np.full(len(self.fed) + 1, -1, dtype=np.int32)
            self.idle[name] = None  # until its first row is set (below), as any state without rows
        prior, follow = ranked(args, batch.artifact)
        batch.add(row, args.k, subset=args.tools, prior=prior, model_weight=args.model_weight, follow=follow)
        self._set(row, args, 0, self.next_serial)
        self.next_serial += 1

    def remove(self, row: int) -> None:
        self.failed.pop(row, None)
        args = self.args.get(row)
        if args is not None:
            self.batches[args.artifact].remove(row)
        self._set(row, None, 0, 0)

    def move(self, source: int, target: int, *, swap: bool) -> None:
        """vLLM moved ``source``'s request to ``target`` (and, with ``swap``, ``target``'s to ``source``)."""
        if source == target:
            return
        failed_moving, failed_displaced = self.failed.pop(source, None), self.failed.pop(target, None)
        if failed_moving is not None:
            self.failed[target] = failed_moving
        if swap and failed_displaced is not None:
            self.failed[source] = failed_displaced
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
        if self.failed:
            self._end_failed(logits, vllm_rows)
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

    def _end_failed(self, logits: torch.Tensor, vllm_rows: npt.NDArray[np.int32]) -> None:
        """Each failed row's logits: -inf but for its stop token (or all -inf where no stop token is known)."""
        for i, row in enumerate(vllm_rows.tolist()):
            stop = self.failed.get(row)
            if stop is not None:
                logits[i] = float("-inf")
                if 0 <= stop < logits.shape[1]:
                    logits[i, stop] = 0.0

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
