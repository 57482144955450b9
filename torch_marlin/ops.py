"""Loads the C++ extension: `import torch_marlin.ops` registers torch.ops.marlin.*.

Schemas and backend kernels live in C++ (csrc/registration.cpp, csrc/cpu/,
csrc/core/metal_plan_*.cpp); each layout's fake kernels and autograd live
with the layout (torch_marlin/layouts/).
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch, which _C links against)

from . import _C  # noqa: F401  (registers torch.ops.marlin.*)


class cpu_int8_activations:
    """Whether the CPU kernels quantize x to int8 for GEMVs (up to 8 rows of x).

    x is quantized per block of 32 values to int8 with an fp32 scale (as
    llama.cpp's Q8_0) and multiplied by the 4-bit codes with integer dot
    products, for the value formats whose values are small integers (fp4, int4,
    uint4, affine; nf4 keeps the float path) and group sizes that are multiples
    of 32. Faster decode for a small loss of precision in x (docs/CPU.md has both).
    A process-wide setting, like torch.set_grad_enabled: it applies when
    called, and as a context manager it restores the previous setting on exit::

        torch_marlin.cpu_int8_activations(True)
        with torch_marlin.cpu_int8_activations(False):
            ...
    """

    def __init__(self, enabled: bool):
        if not isinstance(enabled, bool):
            raise TypeError(f"cpu_int8_activations: enabled must be True or False, got {enabled!r}")
        self.previous = torch.ops.marlin._cpu_int8_activations(enabled)

    def __enter__(self) -> "cpu_int8_activations":
        return self

    def __exit__(self, *exc) -> None:
        torch.ops.marlin._cpu_int8_activations(self.previous)

    @staticmethod
    def enabled() -> bool:
        """The setting in force."""
        return torch.ops.marlin._cpu_int8_activations()
