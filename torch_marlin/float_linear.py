"""The float layers torch_marlin quantizes: nn.Linear and transformers' Conv1D.

Imports nothing of the package, so every floor (the calibration engine, the
modules, the Hugging Face side) asks here what counts as a linear layer.
"""

from __future__ import annotations

import torch
from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2 family): a linear layer that stores its weight as [in, out]."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


def is_float_linear(module: nn.Module) -> bool:
    """A float linear layer MarlinLinear can replace: nn.Linear or Conv1D, exactly
    (subclasses may carry behaviour that replacing them would drop)."""
    return type(module) is nn.Linear or is_conv1d(module)


def linear_weight(weight: torch.Tensor, conv1d: bool = False) -> torch.Tensor:
    """A linear layer's stored weight as the nn.Linear convention W [out, in]."""
    return weight.t() if conv1d else weight
