"""What a training run is told: the LoRA shape and the loop's settings, with their defaults and what they cost.

Plain dataclasses without heavy imports, so ``tooltrie train --help`` shows the defaults without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tooltrie.ranker import DEFAULT_PRIOR, check_prior

__all__ = ["LOSS_NAMES", "PRECISION_NAMES", "SAMPLING_NAMES", "LoraSettings", "TrainSettings"]

LOSS_NAMES = ("plain", "trie", "both")  # train.loss.LOSSES
PRECISION_NAMES = ("bf16", "fp32")
SAMPLING_NAMES = ("balanced", "shuffled")  # train.batches: balanced_batches, shuffled_batches
# Every linear layer of a Llama block: attention and MLP. The tied embedding / output layer stays frozen.
LLAMA_LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSettings:
    # rank 8 on the 7 linear layers of SmolLM2's 30 blocks: 2.4 M parameters, 4.9 MB stored in float16. The rank
    # costs little time (the frozen model's passes dominate), but size: the adapter grows linearly with it.
    rank: int = 8
    alpha: int = 16  # the update is scaled by alpha / rank (peft takes an integer)
    # Dropout on the LoRA inputs costs ~20% of a step on a 2-core CPU, and a run of about one epoch barely overfits.
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LLAMA_LINEAR_LAYERS
    # Adapt only the last N blocks (None: all). The backward pass then stops at the first adapted block: with the
    # top 15 of SmolLM2's 30, a step costs ~0.6x.
    top_layers: int | None = None


@dataclass(frozen=True)
class TrainSettings:
    """Defaults sized for a 2-core CPU: about 40 minutes for the catalog data (see docs/training.md)."""

    steps: int = 350  # time is linear in steps: 5.5-7 CPU seconds each for batch 16 here, ~40 minutes in all
    batch_size: int = 16  # time per step is about linear in it
    learning_rate: float = 1e-3
    warmup_steps: int = 20  # linear warm-up, then cosine decay to zero at the last step
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss: str = "plain"  # "plain" (whole vocabulary) | "trie" (the legal tokens only) | "both": train.loss
    # "balanced": every answer set alike, the rare k boosted (the test split's view); "shuffled": epochs of the data
    sampling: str = "balanced"
    # Attention scores (rows x queries x keys, ``batches.attention_cells``) one pass may hold: a batch of long
    # requests runs in several passes whose gradients add up, so memory stays bounded (16 rows of 340 tokens fit;
    # 16 of 1,063, one BFCL request's length, took 24 GB in one pass).
    max_attention_cells: int = 2_000_000
    # Train the trie loss through the fused ranker (``train.priors``): retrieval's weight, the model's being 1, as
    # the adapter will be served with ``--ranker fused``; 0: the model's choices alone.
    prior_weight: float = 0.0
    prior: str = DEFAULT_PRIOR  # the prior trained through, as served with ``--prior`` (``tooltrie.ranker.PRIORS``)
    lora: LoraSettings = field(default_factory=LoraSettings)
    seed: int = 0  # data order, LoRA initialisation and dropout
    threads: int = 1  # torch threads: one is steadier than two on a CPU shared with other work
    precision: str = "bf16"  # autocast of the training passes ("bf16" | "fp32"); validation is always float32
    eval_every: int = 100  # steps between validations (0: only at the end); each costs about 5 training steps
    eval_examples: int = 128  # validation sample size (0: no validation)

    def __post_init__(self) -> None:
        if self.loss not in LOSS_NAMES:
            raise ValueError(f"unknown loss {self.loss!r}; choose one of {list(LOSS_NAMES)}")
        if self.sampling not in SAMPLING_NAMES:
            raise ValueError(f"unknown sampling {self.sampling!r}; choose one of {list(SAMPLING_NAMES)}")
        if self.precision not in PRECISION_NAMES:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {list(PRECISION_NAMES)}")
        for name in ("steps", "batch_size", "threads", "max_attention_cells"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be at least 0, got {self.prior_weight}")
        check_prior(self.prior, where="training settings")  # a RankerError, a ValueError
        if self.lora.rank < 1:
            raise ValueError(f"the LoRA rank must be at least 1, got {self.lora.rank}")
        if self.lora.top_layers is not None and self.lora.top_layers < 1:
            raise ValueError(f"top_layers must be at least 1 (or None: every block), got {self.lora.top_layers}")
