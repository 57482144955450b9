"""Run the Metal dispatch of torch.ops.marlin.* on the CPU through mslsim.

`run_metal(op_name, *args, **kwargs)` takes the arguments of
`torch.ops.marlin.<op_name>` (CPU tensors), asks the op's C++ dispatch plan
(`torch.ops.marlin._metal_plan_<op_name>`, csrc/core/metal_plan_*.cpp, the
same planner the MPS op runs) which kernels to launch with which grid,
threadgroup size, threadgroup memory, function constants and buffer bindings
and which outputs and workspaces to allocate, runs exactly those launches on
the MSL emulator and returns the op's result as a CPU tensor; if the plan
has a status output (bad input the kernels found), the op's own check
(`torch.ops.marlin._metal_check_<op_name>`, which the MPS op calls too)
raises as on the GPU. Any op with a plan works, bound by its schema: nothing
here is specific to one op.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

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


def emulator():
    """The MSL emulator package mslsim: mslsim/ in the repository, not part of torch_marlin's wheel."""
    try:
        import mslsim
    except ImportError as e:
        raise ImportError("run_metal needs the MSL emulator package mslsim: pip install --no-build-isolation "
                          "./mslsim from the torch_marlin repository (make test installs it)") from e
    return mslsim


def library(source: str):
    """The emulator library of metal/<source>.metal (compiled once per process, cached on disk)."""
    mslsim = emulator()
    d = metal_dir()
    key = (str(d), source, mslsim.flush_subnormals_default())
    with _lock:
        if key not in _libs:
            _libs[key] = mslsim.compile(str(d / f"{source}.metal"), include_dirs=(str(d),))
        return _libs[key]


def _schema(op_name: str):
    """The schema of torch.ops.marlin.<op_name>, if the op has a Metal dispatch plan."""
    import torch_marlin.ops  # noqa: F401  (loads torch.ops.marlin)

    if not isinstance(op_name, str) or not hasattr(torch.ops.marlin, f"_metal_plan_{op_name}"):
        metal_ops = sorted(name[len("_metal_plan_"):] for name in dir(torch.ops.marlin)
                           if name.startswith("_metal_plan_"))
        raise ValueError(f"op_name must be one of {metal_ops}, got {op_name!r}")
    return getattr(torch.ops.marlin, op_name).default._schema


def _bind(op_name: str, args, kwargs) -> Dict[str, Any]:
    """The op's arguments by name (defaults filled in), as torch would bind them."""
    params = _schema(op_name).arguments
    names = [p.name for p in params]
    if len(args) > len(names):
        raise TypeError(f"{op_name}() takes {len(names)} arguments, got {len(args)}")
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"{op_name}() got an unexpected keyword argument {k!r}")
        if k in bound:
            raise TypeError(f"{op_name}() got multiple values for argument {k!r}")
        bound[k] = v
    for p in params:
        if p.name not in bound and p.has_default_value():
            bound[p.name] = p.default_value
    missing = [n for n in names if n not in bound]
    if missing:
        raise TypeError(f"{op_name}() missing arguments {missing}")
    return bound


def metal_plan(op_name: str, *args, **kwargs) -> dict:
    """The dispatch plan (parsed JSON) the MPS path would execute for this call."""
    b = _bind(op_name, args, kwargs)
    return json.loads(getattr(torch.ops.marlin, f"_metal_plan_{op_name}")(**b))


def launch_threadgroup(launch: dict, max_threads_per_threadgroup: Optional[int] = None) -> List[int]:
    """The threadgroup the MPS bridge dispatches `launch` (a plan's launch) with
    on a pipeline allowing at most `max_threads_per_threadgroup` threads (None:
    no limit): the planned one, or one shrunk by the bridge's own C++ rule
    (torch.ops.marlin._metal_fit_threadgroup); raises its error if the kernel
    cannot run within the limit."""
    if max_threads_per_threadgroup is None:
        return list(launch["threadgroup"])
    return list(torch.ops.marlin._metal_fit_threadgroup(launch["kernel"], launch["threadgroup"],
                                                         launch["min_threads_x"], max_threads_per_threadgroup))


def _run_plan(op_name: str, b: Dict[str, Any], schedule: str, seed: int,
              max_threads_per_threadgroup: Optional[int]) -> Tuple[Dict[str, torch.Tensor], dict, List[Any]]:
    """The launches of the op's plan for the bound arguments `b`: every output by name, the plan, the stats."""
    plan = metal_plan(op_name, **b)
    tensors = {}
    for name, value in b.items():
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise ValueError(f"run_metal needs CPU tensors, {name} is on {value.device}")
            tensors[name] = value.contiguous()
        elif value is None:  # an absent optional tensor: bound to a buffer the kernels never read
            tensors[name] = torch.zeros(16, dtype=torch.uint8)
    buffers = [*plan["outputs"], *plan["workspaces"]]
    for spec in buffers:
        tensors[spec["name"]] = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
    stats = []
    for launch in plan["launches"]:
        lib = library(launch["source"])
        bind = {index: value if role == "scalar" else tensors[role] for index, role, value in launch["bindings"]}
        tg_mem = {0: launch["threadgroup_memory"]} if launch["threadgroup_memory"] else {}
        consts = {int(i): v for i, v in launch["constants"].items()}
        threadgroup = launch_threadgroup(launch, max_threads_per_threadgroup)
        stats.append(lib.launch(launch["kernel"], grid=tuple(launch["grid"]),
                                threadgroup=tuple(threadgroup), args=bind,
                                threadgroup_memory=tg_mem, constants=consts,
                                schedule=schedule, seed=seed))
    return {spec["name"]: tensors[spec["name"]] for spec in plan["outputs"]}, plan, stats


def run_metal_outputs(op_name: str, *args, schedule: str = "random", seed: int = 0,
                      max_threads_per_threadgroup: Optional[int] = None,
                      **kwargs) -> Tuple[Dict[str, torch.Tensor], dict, List[Any]]:
    """The launches of run_metal without the op's status check: every output
    buffer of the plan by name (the result not viewed as result_shape), the
    plan and each launch's mslsim LaunchStats. For tests of what the kernels
    report (a plan's "status_output")."""
    b = _bind(op_name, args, kwargs)
    return _run_plan(op_name, b, schedule, seed, max_threads_per_threadgroup)


def run_metal_with_stats(op_name: str, *args, schedule: str = "random", seed: int = 0,
                         max_threads_per_threadgroup: Optional[int] = None,
                         **kwargs) -> Tuple[torch.Tensor, dict, List[Any]]:
    """run_metal, also returning the plan and each launch's mslsim LaunchStats."""
    b = _bind(op_name, args, kwargs)
    outputs, plan, stats = _run_plan(op_name, b, schedule, seed, max_threads_per_threadgroup)
    if plan["status_output"] is not None:  # the kernels' report of bad input: the MPS op's check raises
        getattr(torch.ops.marlin, f"_metal_check_{op_name}")(outputs[plan["status_output"]], **b)
    return outputs[plan["outputs"][0]["name"]].view(plan["result_shape"]), plan, stats


def run_metal(op_name: str, *args, schedule: str = "random", seed: int = 0,
              max_threads_per_threadgroup: Optional[int] = None, **kwargs) -> torch.Tensor:
    """torch.ops.marlin.<op_name>(*args, **kwargs) through its Metal dispatch, on the emulator.

    max_threads_per_threadgroup: run as on a GPU whose pipelines allow at most
    this many threads per threadgroup (Metal's maxTotalThreadsPerThreadgroup):
    the launches are sized by the MPS bridge's rule (launch_threadgroup)."""
    return run_metal_with_stats(op_name, *args, schedule=schedule, seed=seed,
                                max_threads_per_threadgroup=max_threads_per_threadgroup, **kwargs)[0]


__all__ = ["metal_dir", "library", "metal_plan", "launch_threadgroup", "run_metal", "run_metal_with_stats",
           "run_metal_outputs"]
