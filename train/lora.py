"""LoRA through peft: attaching trainable low-rank matrices to a model, and taking them out for saving.

peft is needed for training only (the ``train`` extra); loading a trained adapter merges it without peft
(``tooltrie.serve.adapter.merge_adapter``).
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any, cast

import torch

from tooltrie.errors import TooltrieError
from tooltrie.train.settings import LoraSettings

__all__ = ["PEFT_REQUIREMENT", "TrainingSetupError", "attach_lora", "lora_tensors"]

PEFT_REQUIREMENT = "peft==0.21.2"


class TrainingSetupError(TooltrieError, RuntimeError):
    """What training needs is missing (e.g. the peft package)."""


def attach_lora(model: torch.nn.Module, settings: LoraSettings) -> Any:
    """Wrap ``model`` in a peft ``PeftModel`` whose only trainable parameters are the LoRA matrices (initialised
    from torch's global random state: seed it first). The model's layers are changed in place."""
    if importlib.util.find_spec("peft") is None:
        raise TrainingSetupError(f"training needs peft: `pip install '{PEFT_REQUIREMENT}'` "
                                 "(or `pip install -e '.[train]'`)")
    from peft import LoraConfig, get_peft_model

    layers = None
    if settings.top_layers is not None:
        blocks = int(cast(Any, model).config.num_hidden_layers)
        if settings.top_layers > blocks:
            raise TrainingSetupError(f"top_layers is {settings.top_layers} but the model has {blocks} blocks")
        layers = list(range(blocks - settings.top_layers, blocks))
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), layers_to_transform=layers, bias="none")
    with warnings.catch_warnings():
        # peft 0.21 asks transformers 5.2x a deprecated question (is_gradient_checkpointing); nothing to act on.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def lora_tensors(peft_model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The LoRA matrices under peft's names, and peft's config as a dict (what ``adapter_config.json`` holds)."""
    from peft import get_peft_model_state_dict

    tensors = {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(peft_model).items()}
    config = peft_model.peft_config["default"].to_dict()
    return tensors, config
