"""What the MPS bridge decides from the Mac and its pipelines, in C++
(csrc/core/metal_plan.cpp) so it is tested here: which Macs are supported,
how a launch is sized when a pipeline allows fewer threads than planned, the
32-lane simdgroup check; and the GEMV run with fewer simdgroups on the
emulator through the same rule. Then rules on the bridge's source
(csrc/mps/metal_encode.mm) that hold without clang: an API newer than the
macOS floor is behind a compile-time SDK guard as well as @available, the
compiles drain an autorelease pool, every dispatch is labelled; and bfloat
kernels exactly where the Metal compiler has bfloat."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import torch_marlin.ops  # noqa: F401
import mslsim
from torch_marlin.testing.metal import launch_threadgroup, metal_dir, metal_plan, run_metal

from metal_helpers import GEMM_TOL, make_weight, rel_err

fit = torch.ops.marlin._metal_fit_threadgroup
problem = torch.ops.marlin._metal_support_problem

ROOT = Path(__file__).resolve().parents[2]
BRIDGE = ROOT / "csrc" / "mps" / "metal_encode.mm"
_spec = importlib.util.spec_from_file_location("embed_metal", ROOT / "csrc" / "mps" / "embed_metal.py")
embed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(embed)


def test_supported_macs():
    assert problem(14, 0, True) == "" and problem(15, 4, True) == "" and problem(26, 0, True) == ""
    old = problem(13, 6, True)
    assert "macOS 14.0 or newer" in old and "macOS 13.6" in old and "bfloat" in old
    assert "Apple-silicon GPU" in problem(14, 5, False)


def _launches(m, n=96, k=256, fmt="fp4", op="gemm"):
    packed, scales, zeros = make_weight(fmt, k, n, 64)
    if op == "dequantize":
        return metal_plan("dequantize", packed, scales, zeros, fmt, 64)["launches"]
    x = torch.randn(m, k, dtype=torch.float16)
    return metal_plan("gemm", x, packed, scales, zeros, None, fmt, 64)["launches"]


def test_plans_say_which_kernels_may_shrink():
    (gemv,) = _launches(1)
    assert gemv["threadgroup"] == [256, 1, 1] and gemv["min_threads_x"] == 32
    (fused,) = _launches(16)
    tiled, reduce = _launches(130, n=64, k=8192)
    (dequant,) = _launches(0, op="dequantize")
    for launch in (fused, tiled, dequant):  # 128-thread GEMMs, dequantize
        assert launch["min_threads_x"] == 0, launch["kernel"]
    assert reduce["threadgroup"] == [256, 1, 1] and reduce["min_threads_x"] == 32  # loops over its outputs


def test_fit_threadgroup():
    assert fit("k", [256, 1, 1], 32, 1024) == [256, 1, 1]  # fits: as planned
    assert fit("k", [256, 1, 1], 32, 256) == [256, 1, 1]
    assert fit("k", [256, 1, 1], 32, 255) == [224, 1, 1]  # whole simdgroups
    assert fit("k", [256, 1, 1], 32, 100) == [96, 1, 1]
    assert fit("k", [256, 1, 1], 32, 32) == [32, 1, 1]
    with pytest.raises(RuntimeError, match=r"kernel k needs 32 threads per threadgroup, but this GPU's pipeline "
                                           r"allows only 31 \(maxTotalThreadsPerThreadgroup\)"):
        fit("k", [256, 1, 1], 32, 31)
    with pytest.raises(RuntimeError, match="kernel marlin_gemm_fused_fp4_f16_tm32 needs 128 threads per threadgroup, "
                                           "but this GPU's pipeline allows only 96"):
        fit("marlin_gemm_fused_fp4_f16_tm32", [128, 1, 1], 0, 96)
    with pytest.raises(RuntimeError, match="needs 128 threads"):
        fit("marlin_dequant_fp4_f16", [32, 4, 1], 0, 64)
    assert fit("k", [32, 4, 1], 0, 128) == [32, 4, 1]


def test_simd_width_must_be_32():
    assert fit("k", [128, 1, 1], 0, 1024, 32) == [128, 1, 1]
    with pytest.raises(RuntimeError, match="kernel k is written for 32-lane simdgroups, but this GPU runs 64 threads "
                                           "per SIMD group"):
        fit("k", [128, 1, 1], 0, 1024, 64)


def test_emulator_uses_the_bridge_rule():
    (gemv,) = _launches(3)
    assert launch_threadgroup(gemv) == [256, 1, 1]
    assert launch_threadgroup(gemv, 200) == [192, 1, 1]
    (fused,) = _launches(16)
    with pytest.raises(RuntimeError, match="needs 128 threads"):
        run_metal("gemm", torch.randn(16, 256, dtype=torch.float16), *make_weight("fp4", 256, 96, 64), None,
                  "fp4", 64, max_threads_per_threadgroup=64)


@pytest.mark.parametrize("m,max_threads,fmt", [(1, 32, "fp4"), (3, 96, "uint4"), (8, 64, "int4"), (8, 160, "fp4")])
def test_gemv_with_fewer_simdgroups_matches_cpu(m, max_threads, fmt):
    # Fewer simdgroups than planned split K among themselves, and the epilogue
    # (MR rows x 32 columns) loops over the threads it has.
    n, k, group = 72, 512, 64  # a partial last column block; 64 packed rows for 1-5 simdgroups
    packed, scales, zeros = make_weight(fmt, k, n, group, gen=torch.Generator().manual_seed(m))
    x = torch.randn(m, k, dtype=torch.float16)
    bias = torch.randn(n, dtype=torch.float16)
    want = torch.ops.marlin.gemm(x, packed, scales, zeros, bias, fmt, group)
    got = run_metal("gemm", x, packed, scales, zeros, bias, fmt, group, max_threads_per_threadgroup=max_threads,
                    seed=m)
    assert rel_err(got, want) <= GEMM_TOL[torch.float16]


def _dequant_kernels(source='#include "dequant.metal"\n', **defines):
    return set(mslsim.compile(source, include_dirs=(str(metal_dir()),), defines=defines).kernels())


def test_bfloat_kernels_only_from_metal_3_1():
    # Metal < 3.1 has no bfloat: the instantiations are guarded, so such a
    # compiler builds the other kernels instead of failing (the bridge itself
    # always compiles for 3.1, on the macOS floor it checks first).
    names = _dequant_kernels(__METAL_VERSION__=300)
    assert names and not any("bf16" in n for n in names)
    assert {f"marlin_dequant_{f}_{d}" for f in ("fp4", "int4", "uint4") for d in ("f16", "f32")} <= names


def test_bfloat_kernels_follow_have_bfloat():
    # The compiler says whether it has bfloat (__HAVE_BFLOAT__); the kernels
    # follow it, not a Metal version of their own.
    assert {"marlin_dequant_fp4_bf16", "marlin_dequant_uint4_bf16"} <= _dequant_kernels()
    without = _dequant_kernels('#undef __HAVE_BFLOAT__\n#include "dequant.metal"\n')
    assert without and not any("bf16" in n for n in without)
    assert "marlin_dequant_fp4_f16" in without


# --- rules on the bridge's source ----------------------------------------------

_VERSION = re.compile(r"(\d+)(?:[._](\d+))?")


def _version(text):
    major, minor = _VERSION.fullmatch(text).groups()
    return int(major), int(minor or 0)


def sdk_guard_problems(source, floor=embed.MACOS_FLOOR):
    """Lines of `source` with an @available check above the macOS floor outside
    a compile-time SDK guard for that version. An API introduced in macOS N is
    declared only by the SDKs of N and newer, and @available is a run-time
    check: an SDK between the floor and N (Xcode 15 for N = 15) fails to
    compile it. The guard must test `defined(__MAC_N_0)` too: an SDK that does
    not know N leaves __MAC_N_0 undefined, which #if reads as 0 (always true)."""
    guard = re.compile(r"defined\(__MAC_(\d+_\d+)\)\s*&&\s*__MAC_OS_X_VERSION_MAX_ALLOWED\s*>=\s*__MAC_(\d+_\d+)")
    problems, open_ifs = [], []
    for number, line in enumerate(source.splitlines(), 1):
        directive = re.match(r"\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)", line)
        if directive:
            kind, condition = directive.groups()
            if kind.startswith("if"):
                open_ifs.append(condition)
            elif kind == "endif":
                open_ifs.pop()
            else:  # another branch: guarded by its own condition (#elif) or none (#else)
                open_ifs[-1] = condition if kind == "elif" else ""
            continue
        for needed in map(_version, re.findall(r"@available\(macOS (\d+(?:\.\d+)?)", line)):
            if needed <= _version(floor):
                continue
            guards = [m for c in open_ifs for m in guard.finditer(c) if m.group(1) == m.group(2)]
            if not any(_version(m.group(1)) >= needed for m in guards):
                problems.append((number, line.strip()))
    return problems


def test_apis_newer_than_the_floor_are_behind_an_sdk_guard():
    src = BRIDGE.read_text()
    assert "@available(macOS 15.0, *)" in src  # the rule has something to check
    assert sdk_guard_problems(src) == []
    # the rule sees an unguarded use, a guard without defined(), a guard for an
    # older SDK, and the #else branch of a guard
    unguarded = re.sub(r"#if defined\(__MAC_15_0\).*\n((?:.*\n)*?)#endif\n", r"\1", src)
    assert unguarded != src and len(sdk_guard_problems(unguarded)) == 1
    undefined_is_zero = src.replace("#if defined(__MAC_15_0) && ", "#if ")
    assert len(sdk_guard_problems(undefined_is_zero)) == 1
    assert len(sdk_guard_problems(src.replace("__MAC_15_0", "__MAC_14_0"))) == 1
    assert sdk_guard_problems("#if defined(__MAC_15_0) && __MAC_OS_X_VERSION_MAX_ALLOWED >= __MAC_15_0\n#else\n"
                              "if (@available(macOS 15.0, *)) {}\n#endif\n") == [(3, "if (@available(macOS 15.0, *)) {}")]
    assert sdk_guard_problems("if (@available(macOS 14.0, *)) {}\n") == []  # the floor itself


def _body(src, start):
    """The brace-balanced block that begins at the first '{' after `start`."""
    i = src.index("{", src.index(start))
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[i:j + 1]
    raise AssertionError(f"unbalanced braces after {start!r}")


def test_compiles_drain_an_autorelease_pool():
    # The callers (Python threads) have no autorelease pool; a C++ exception
    # thrown inside @autoreleasepool leaves the pool undrained, so the checks
    # come after it.
    src = BRIDGE.read_text()
    compiling = ("newLibraryWithData:", "newLibraryWithSource:", "newFunctionWithName:",
                 "newComputePipelineStateWith")
    pools = [_body(src[m.start():], "@autoreleasepool") for m in re.finditer(r"@autoreleasepool", src)]
    for call in compiling:
        assert src.count(call) == 1, call
        assert any(call in pool for pool in pools), f"{call} outside an @autoreleasepool"
    for pool in pools:
        assert "TORCH_CHECK" not in pool, pool


def test_pipelines_and_dispatches_are_labelled():
    # Kernel names in Xcode's Metal debugger and profiler: the pipeline from a
    # labelled descriptor, each dispatch in a debug group of its kernel (torch's
    # encoder is shared by other ops, so its own label is left alone).
    src = BRIDGE.read_text()
    assert "newComputePipelineStateWithFunction" not in src
    pipeline = _body(src, "id<MTLComputePipelineState> pipeline(")
    assert re.search(r"descriptor\.label = \[NSString stringWithUTF8String:key\.c_str\(\)\];", pipeline)
    assert "descriptor.computeFunction = function;" in pipeline
    assert "newComputePipelineStateWithDescriptor:descriptor" in pipeline
    loop = _body(src, "for (size_t i = 0; i < p->launches.size(); ++i)")
    push = loop.index("[encoder pushDebugGroup:[NSString stringWithUTF8String:l.kernel.c_str()]];")
    dispatch = loop.index("[encoder dispatchThreadgroups:")
    pop = loop.index("[encoder popDebugGroup];")
    assert push < loop.index("[encoder setComputePipelineState:") < dispatch < pop
    assert loop.count("pushDebugGroup") == loop.count("popDebugGroup") == 1
    assert "encoder.label" not in src and "setLabel" not in src
