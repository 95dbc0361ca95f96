"""How ``tooltrie serve --train`` trains a registry's adapter: the ``Recipe``, its cache key and the command that runs
it (``python -m tooltrie.train.job``). The server (``serve/training.py``) takes a recipe as its ``TrainingJob`` and
knows nothing more of the training code.

An adapter's cache key is a sha256 of everything it depends on: the registry, tokenizer and contract (the artifact's
hashes), the fingerprint of the model it is trained on, the recipe's settings, the training code's version (its
source files' sha256: any change to ``train/`` trains anew) and the content of the replayed data (the bundled
registry and labelled sets the recipe replays, by their bytes, not their names).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tooltrie.ranker import DEFAULT_PRIOR, SERVE_TRAINED, Weights, check_prior

if TYPE_CHECKING:
    from tooltrie.compiler.artifact import Artifact

__all__ = ["Recipe", "replayed_sets", "training_code_version"]

KEY_VERSION = 2  # bumped when what a key is made of changes
JOB_MODULE = "tooltrie.train.job"


@dataclass(frozen=True)
class Recipe:
    """How a served registry's adapter is trained: data from the registry's own text, then a short LoRA run sized
    for a 2-core CPU (a 1,853-tool registry: see docs/training.md)."""

    compose: int = 2_000  # multi-tool requests composed from the tools' descriptions (``train.compose``)
    self_instruct: int = 0  # requests per tool written by the instruct model (``train.self_instruct``)
    # The bundled registry ("catalog" or "bfcl") whose labelled requests are drawn beside the registry's text
    # (``train.job``; None: the text alone). Text alone teaches the tools but unlearns how requests read: on BFCL,
    # 54.0 % exact sets fused without them, 58.4 % with the catalog's (docs/training.md#training-while-serving).
    replay: str | None = "catalog"
    hard_negatives: bool = False  # each tool's requests beside its nearest tool's (``train.hard_negatives``)
    # Train the choices through ``fused`` as they are served (``train.priors``): the model learns what retrieval misses
    through_prior: bool = False
    prompt_style: str = "short"  # the prompt the adapter learns to answer (``serve.prompt``)
    steps: int = 200
    batch_size: int = 16
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    rank: int = 32
    alpha: int = 64
    top_layers: int = 15  # the backward pass stops halfway: a step costs about 0.6x
    loss: str = "both"
    seed: int = 0
    threads: int = 1  # one core for training, the other for serving
    # The fused ranker's weights the adapter is served with (``ranker.SERVE_TRAINED``, where they were chosen)
    fused: Weights = SERVE_TRAINED
    prior: str = DEFAULT_PRIOR  # the retrieval prior trained through (``through_prior``), as served with ``--prior``

    def __post_init__(self) -> None:
        check_prior(self.prior, where="recipe")

    def key(self, artifact: Artifact, base_fingerprint: str) -> str:
        """The cache key of this recipe's adapter for ``artifact`` on the base with ``base_fingerprint``."""
        parts = [KEY_VERSION, artifact.registry.sha256, artifact.tokenizer_fingerprint, artifact.contract.sha256,
                 base_fingerprint, asdict(self), training_code_version(), _replayed_content(self.replay)]
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()

    def command(self, artifact_file: Path, output: Path, *, work: Path, base_model: str | None,
                base_adapter: bool) -> list[str]:
        """The command that trains this recipe's adapter of the artifact saved at ``artifact_file`` into
        ``output``."""
        command = [sys.executable, "-m", JOB_MODULE, str(artifact_file), str(output), "--work", str(work),
                   "--recipe", self.to_json()]
        if base_model is not None:
            command += ["--base-model", base_model]
        if not base_adapter:
            command.append("--no-base-adapter")
        return command

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        fields = json.loads(text)
        return cls(**{**fields, "fused": Weights(**fields["fused"])})


@functools.cache
def training_code_version() -> str:
    """A sha256 of the training code's source (every module of ``tooltrie.train``): an adapter trained by other
    code is another adapter."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(f"\0{path.name}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def replayed_sets(registry: str) -> tuple[list[str], Path]:
    """The bundled labelled sets with a train split of the bundled registry named ``registry`` ("catalog": MetaTool's
    two and the situations written to train on, "bfcl"), and that registry's file. Sets split in halves (validation
    and test only, e.g. the need-describing requests) are never trained on."""
    from tooltrie.eval.datasets import BUNDLED, registry_path

    trained = [name for name, bundled in BUNDLED.items() if not bundled.halves]
    sets = [name for name in trained if registry_path(name).stem == registry]
    if not sets:
        names = sorted({registry_path(name).stem for name in trained})
        raise ValueError(f"recipe: replay {registry!r} is not a bundled registry with labelled requests; "
                         f"choose one of {', '.join(names)}")
    return sets, registry_path(sets[0])


@functools.cache
def _replayed_content(replay: str | None) -> str | None:
    """A sha256 of the bytes of what ``replay`` draws: the bundled registry's file and its labelled sets' files."""
    if replay is None:
        return None
    from tooltrie.eval.datasets import BUNDLED, DATA_DIR

    sets, registry = replayed_sets(replay)
    digest = hashlib.sha256(registry.read_bytes())
    for name in sets:
        digest.update(f"\0{name}\0".encode())
        digest.update((DATA_DIR / BUNDLED[name].file).read_bytes())
    return digest.hexdigest()
