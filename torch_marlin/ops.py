"""Loads the C++ extension: `import torch_marlin.ops` registers torch.ops.marlin.*.

Schemas and backend kernels live in C++ (csrc/registration.cpp, csrc/cpu/,
csrc/core/metal_plan_*.cpp); each layout's fake kernels and autograd live
with the layout (torch_marlin/layouts/).
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch, which _C links against)

from . import _C  # noqa: F401  (registers torch.ops.marlin.*)
