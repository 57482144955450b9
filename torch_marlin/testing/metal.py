"""Run the Metal dispatch of torch.ops.marlin.* on the CPU through mslsim.

`run_metal(op_name, *args, **kwargs)` takes the arguments of
`torch.ops.marlin.<op_name>` (CPU tensors), asks the C++ dispatch plan
(`torch.ops.marlin._metal_plan`, csrc/core/metal_plan.cpp, the function the
MPS bridge uses) which kernels to launch with which grid, threadgroup size,
threadgroup memory, function constants and buffer bindings, runs exactly
those launches on the MSL emulator and returns the op's result as CPU tensors.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
_SIGNATURES = {
    "gemm": ("x", "packed", "scales", "zeros", "bias", "weight_format", "group_size"),
    "dequantize": ("packed", "scales", "zeros", "weight_format", "group_size", "dtype"),
}
_DEFAULTS = {"dequantize": {"dtype": None}}

_libs: Dict[Tuple[str, str], Any] = {}
_lock = threading.Lock()


def metal_dir() -> Path:
    """Directory holding the .metal sources and marlin_dequant.h."""
    env = os.environ.get("TORCH_MARLIN_METAL_DIR")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [here.parents[2] / "metal", here.parents[1] / "metal"]
    for c in candidates:
        if (c / "marlin_dequant.h").is_file():
            return c
    raise FileNotFoundError(f"Metal sources not found in {[str(c) for c in candidates]}")


def library(source: str):
    """The emulator library of metal/<source>.metal (compiled once per process, cached on disk)."""
    from . import mslsim

    d = metal_dir()
    key = (str(d), source)
    with _lock:
        if key not in _libs:
            _libs[key] = mslsim.compile(str(d / f"{source}.metal"), include_dirs=(str(d),))
        return _libs[key]


def _bind(op_name: str, args, kwargs) -> Dict[str, Any]:
    if op_name not in _SIGNATURES:
        raise ValueError(f"op_name must be one of {tuple(_SIGNATURES)}, got {op_name!r}")
    names = _SIGNATURES[op_name]
    if len(args) > len(names):
        raise TypeError(f"{op_name}() takes {len(names)} arguments, got {len(args)}")
    bound = dict(_DEFAULTS.get(op_name, {}))
    bound.update(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"{op_name}() got an unexpected keyword argument {k!r}")
        if k in names[: len(args)]:
            raise TypeError(f"{op_name}() got multiple values for argument {k!r}")
        bound[k] = v
    missing = [n for n in names if n not in bound]
    if missing:
        raise TypeError(f"{op_name}() missing arguments {missing}")
    return bound


def metal_plan(op_name: str, *args, **kwargs) -> dict:
    """The dispatch plan (parsed JSON) the MPS path would execute for this call."""
    import torch_marlin.ops  # noqa: F401  (loads torch.ops.marlin)

    b = _bind(op_name, args, kwargs)
    return json.loads(torch.ops.marlin._metal_plan(
        op_name, b["packed"], b["scales"], b["zeros"], b.get("x"), b.get("bias"),
        b["weight_format"], b["group_size"], b.get("dtype")))


def run_metal_with_stats(op_name: str, *args, schedule: str = "random", seed: int = 0,
                         **kwargs) -> Tuple[torch.Tensor, dict, List[Any]]:
    """run_metal, also returning the plan and each launch's mslsim LaunchStats."""
    b = _bind(op_name, args, kwargs)
    plan = metal_plan(op_name, **b)
    for name in ("x", "packed", "scales", "zeros", "bias"):
        t = b.get(name)
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise ValueError(f"run_metal needs CPU tensors, {name} is on {t.device}")
    dtype = _DTYPES[plan["dtype"]]
    m, n, k = plan["M"], plan["N"], plan["K"]
    if op_name == "gemm":
        x = b["x"]
        out_shape = (*x.shape[:-1], n)
        out = torch.empty((m, n), dtype=dtype)
    else:
        out_shape = (k, n)
        out = torch.empty((k, n), dtype=dtype)
    tensors = {
        "x": b["x"].reshape(m, k).contiguous() if op_name == "gemm" else None,
        "packed": b["packed"],
        "scales": b["scales"],
        # Unused inputs still need a buffer bound (never read by the kernels).
        "zeros": b["zeros"] if b["zeros"] is not None else torch.zeros(8, dtype=torch.float16),
        "bias": b.get("bias") if b.get("bias") is not None else torch.zeros(8, dtype=dtype),
        "out": out,
        "partial": torch.empty(max(plan["partial_floats"], 4), dtype=torch.float32),
    }
    stats = []
    for launch in plan["launches"]:
        lib = library(launch["source"])
        bind = {}
        for index, role, value in launch["bindings"]:
            bind[index] = value if role == "scalar" else tensors[role]
        tg_mem = {0: launch["threadgroup_memory"]} if launch["threadgroup_memory"] else {}
        consts = {int(i): v for i, v in launch["constants"].items()}
        stats.append(lib.launch(launch["kernel"], grid=tuple(launch["grid"]),
                                threadgroup=tuple(launch["threadgroup"]), args=bind,
                                threadgroup_memory=tg_mem, constants=consts,
                                schedule=schedule, seed=seed))
    return out.view(out_shape), plan, stats


def run_metal(op_name: str, *args, schedule: str = "random", seed: int = 0, **kwargs) -> torch.Tensor:
    """torch.ops.marlin.<op_name>(*args, **kwargs) through its Metal dispatch, on the emulator."""
    return run_metal_with_stats(op_name, *args, schedule=schedule, seed=seed, **kwargs)[0]


__all__ = ["metal_dir", "library", "metal_plan", "run_metal", "run_metal_with_stats"]
