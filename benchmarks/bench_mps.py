"""Benchmark of the Metal kernels.

On a Mac with MPS (and torch_marlin built with the MPS bridge): median time,
GB/s and speed-up of torch.ops.marlin.gemm against fp16 torch.matmul and
torch._weight_int4pack_mm on MPS, for M in {1, 4, 16, 64, 256} on LLaMA-7B
layer shapes, with warm-up and rotating weight buffers (several copies of the
weights, more bytes than the GPU caches, used round-robin).

Everywhere else (Linux CI): per kernel and shape, the device bytes the
dispatch plan's launches request (without cache hits) and their threadgroup
memory, against the ideal traffic (weights, scales/zeros and activations read
once, output written once). Nothing is timed there: the emulator says nothing
about GPU speed.

With --sparse: the 2:4 sparse layout (torch.ops.marlin.sparse24_gemm) against
the dense layout of the same format, the same way (plan traffic everywhere,
median times on a Mac).

    python3 benchmarks/bench_mps.py [--format fp4] [--group-size 128] [--plan-only] [--sparse]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import torch_marlin.ops  # noqa: F401
from torch_marlin.formats import WEIGHT_FORMATS
from torch_marlin.testing.metal import metal_plan

SHAPES = {  # name: (N, K) of W^T = B [K, N]
    "qkv/o_proj 4096x4096": (4096, 4096),
    "gate/up 11008x4096": (11008, 4096),
    "down 4096x11008": (4096, 11008),
}
M_VALUES = (1, 4, 16, 64, 256)
DTYPE_SIZE = {"f16": 2, "bf16": 2, "f32": 4}


def ideal_bytes(m, n, k, groups, fmt, t, sparse=False):
    codes = k // 16 * n * 4 + k // 32 * n * 4 if sparse else k // 8 * n * 4  # 2:4: values + metadata
    weights = codes + groups * n * 2 * (2 if fmt == "uint4" else 1)
    return weights + m * k * t + m * n * t


def plan_bytes(plan, fmt):
    """Device bytes requested by the plan's launches, counting every threadgroup's loads."""
    m, n, k, t = plan["M"], plan["N"], plan["K"], DTYPE_SIZE[plan["dtype"]]
    groups = k // plan["group_rows"]
    sz = 2 if fmt == "uint4" else 1  # scales (+ zeros), fp16
    total = 0
    for l in plan["launches"]:
        gx, gy, gz = l["grid"]
        name = l["kernel"]
        if name.startswith("marlin_gemv_"):
            # weights once; every packed row reloads its group's scales (L1/L2 hits);
            # every threadgroup reads all of x
            total += k // 8 * n * 4 + k // 8 * n * 2 * sz + gx * m * k * t + m * n * t
        elif name.startswith(("marlin_gemm_fused_", "marlin_gemm_tiled_")):
            tm = 64 if "tiled" in name or name.endswith("tm64") else 32
            tiles_m = gy
            # per (m-tile): all weights of the N range and their per-row params, x rows of the tile
            total += tiles_m * (k // 8 * n * 4 + k // 8 * n * 2 * sz) + gx * m * k * t
            total += m * n * (4 * gz if gz > 1 else t)
            del tm
        elif name.startswith("marlin_reduce_"):
            splits = plan["splits"]
            total += splits * m * n * 4 + m * n * t
        elif name.startswith("marlin_dequant_"):
            total += k // 8 * n * 4 + k // 8 * n * 2 * sz + k * n * t
        elif name.startswith("marlin_sparse24_gemv_"):
            # values and metadata once (the odd values row's lanes share the even one's metadata load);
            # every values row reloads its group's params; every threadgroup reads all of x
            total += k // 16 * n * 4 + k // 32 * n * 4 + k // 16 * n * 2 * sz + gx * m * k * t + m * n * t
        elif name.startswith("marlin_sparse24_gemm_"):
            total += gy * (k // 16 * n * 4 + k // 32 * n * 4 + k // 16 * n * 2 * sz) + gx * m * k * t
            total += m * n * (4 * gz if gz > 1 else t)
        elif name.startswith("marlin_sparse24_dequant_"):
            total += k // 16 * n * 4 + k // 32 * n * 4 + k // 16 * n * 2 * sz + k * n * t
    sparse = plan_is_sparse(plan)
    return total, ideal_bytes(m, n, k, groups, fmt, t, sparse)


def plan_is_sparse(plan):
    return any(l["kernel"].startswith("marlin_sparse24_") for l in plan["launches"])


def sparse_meta_inputs(m, n, k, fmt, gs, dtype, device="meta"):
    x, _, scales, zeros = meta_inputs(m, n, k, fmt, gs, dtype, device)
    values = torch.empty(k // 16, n, dtype=torch.int32, device=device)
    metadata = torch.empty(k // 32, n, dtype=torch.int32, device=device)
    return x, values, metadata, scales, zeros


def report_sparse_plans(fmt, gs, dtype=torch.float16):
    """Requested device bytes of the 2:4 plans against the dense plans of the same problem."""
    print(f"# 2:4 sparse vs dense plan traffic, format={fmt}, group_size={gs}, dtype={dtype}")
    print(f"{'shape':24} {'M':>5} {'sparse kernels':40} {'MB dense':>9} {'MB 2:4':>9} {'req. x':>7} "
          f"{'ideal x':>7}")
    for name, (n, k) in SHAPES.items():
        for m in M_VALUES:
            dense = metal_plan("gemm", *meta_inputs(m, n, k, fmt, gs, dtype), None, fmt, gs)
            x, values, metadata, scales, zeros = sparse_meta_inputs(m, n, k, fmt, gs, dtype)
            sparse = metal_plan("sparse24_gemm", x, values, metadata, scales, zeros, None, fmt, gs)
            (dreq, dideal), (sreq, sideal) = plan_bytes(dense, fmt), plan_bytes(sparse, fmt)
            kernels = "+".join(l["kernel"].replace("marlin_", "") for l in sparse["launches"])
            print(f"{name:24} {m:5d} {kernels:40} {dreq / 1e6:9.2f} {sreq / 1e6:9.2f} {dreq / sreq:7.2f} "
                  f"{dideal / sideal:7.2f}")


def meta_inputs(m, n, k, fmt, gs, dtype, device="meta"):
    groups = 1 if gs == -1 else k // gs
    packed = torch.empty(k // 8, n, dtype=torch.int32, device=device)
    scales = torch.empty(groups, n, dtype=torch.float16, device=device)
    zeros = torch.empty(groups, n, dtype=torch.float16, device=device) if fmt == "uint4" else None
    x = torch.empty(m, k, dtype=dtype, device=device)
    return x, packed, scales, zeros


def report_plans(fmt, gs, dtype=torch.float16):
    print(f"# dispatch plan traffic, format={fmt}, group_size={gs}, dtype={dtype}")
    print(f"{'shape':24} {'M':>5} {'kernels':44} {'grid':>16} {'tg mem':>7} {'MB req':>9} {'MB ideal':>9} {'ratio':>6}")
    for name, (n, k) in SHAPES.items():
        for m in M_VALUES:
            x, packed, scales, zeros = meta_inputs(m, n, k, fmt, gs, dtype)
            plan = metal_plan("gemm", x, packed, scales, zeros, None, fmt, gs)
            req, ideal = plan_bytes(plan, fmt)
            kernels = "+".join(l["kernel"].replace("marlin_", "") for l in plan["launches"])
            grid = "x".join(map(str, plan["launches"][0]["grid"]))
            tg = max(l["threadgroup_memory"] for l in plan["launches"])
            print(f"{name:24} {m:5d} {kernels:44} {grid:>16} {tg:7d} {req / 1e6:9.2f} {ideal / 1e6:9.2f} {req / ideal:6.2f}")


def _median_ms(fn, n_iter=50, warmup=10):
    for _ in range(warmup):
        fn()
    torch.mps.synchronize()
    times = []
    for _ in range(n_iter):
        t0 = time.perf_counter()
        fn()
        torch.mps.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _int4pack_fn(x, n, k, gs, copies):
    """torch._weight_int4pack_mm on MPS, or None when this torch does not offer it."""
    try:
        ws = []
        for _ in range(copies):
            q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="mps")
            try:
                packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 2)
            except Exception:  # noqa: BLE001 - older signature: int32 [N, K]
                packed = torch._convert_weight_to_int4pack(q, 2)
            sz = torch.rand(k // gs, n, 2, dtype=x.dtype, device="mps")
            ws.append((packed, sz))
        torch._weight_int4pack_mm(x, ws[0][0], gs, ws[0][1])
    except Exception as e:  # noqa: BLE001
        print(f"  (torch._weight_int4pack_mm unavailable: {type(e).__name__}: {str(e).splitlines()[0]})")
        return None
    it = [0]

    def run():
        p, s = ws[it[0] % copies]
        it[0] += 1
        return torch._weight_int4pack_mm(x, p, gs, s)

    return run


def bench_device(fmt, gs, cache_bytes=256 << 20):
    dev = "mps"
    print(f"# MPS timings, format={fmt}, group_size={gs}, fp16 activations (median ms)")
    print(f"{'shape':24} {'M':>5} {'marlin':>8} {'GB/s':>7} {'fp16 mm':>8} {'x':>6} {'int4pack':>9} {'x':>6}")
    for name, (n, k) in SHAPES.items():
        weight_bytes = k // 8 * n * 4
        copies = max(2, min(32, math.ceil(cache_bytes / weight_bytes)))
        groups = k // gs
        ws = []
        for _ in range(copies):
            packed = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
            scales = torch.rand(groups, n, dtype=torch.float16, device=dev)
            zeros = torch.rand(groups, n, dtype=torch.float16, device=dev) * 15 if fmt == "uint4" else None
            ws.append((packed, scales, zeros))
        dense = [torch.randn(n, k, dtype=torch.float16, device=dev) for _ in range(max(2, copies // 4))]
        for m in M_VALUES:
            x = torch.randn(m, k, dtype=torch.float16, device=dev)
            it = [0]

            def marlin():
                p, s, z = ws[it[0] % copies]
                it[0] += 1
                return torch.ops.marlin.gemm(x, p, s, z, None, fmt, gs)

            jt = [0]

            def fp16():
                w = dense[jt[0] % len(dense)]
                jt[0] += 1
                return x @ w.t()

            t_m = _median_ms(marlin)
            t_f = _median_ms(fp16)
            i4 = _int4pack_fn(x, n, k, gs, copies)
            t_i = _median_ms(i4) if i4 else float("nan")
            ideal = ideal_bytes(m, n, k, groups, fmt, 2)
            print(f"{name:24} {m:5d} {t_m:8.3f} {ideal / t_m / 1e6:7.1f} {t_f:8.3f} {t_f / t_m:6.2f} "
                  f"{t_i:9.3f} {t_i / t_m:6.2f}")


def bench_sparse_device(fmt, gs, cache_bytes=256 << 20):
    """Median ms of sparse24_gemm against gemm of the same format on MPS (rotating weight copies)."""
    dev = "mps"
    print(f"# MPS timings, 2:4 sparse vs dense, format={fmt}, group_size={gs}, fp16 activations (median ms)")
    print(f"{'shape':24} {'M':>5} {'dense':>8} {'2:4':>8} {'x':>6}")
    for name, (n, k) in SHAPES.items():
        copies = max(2, min(32, math.ceil(cache_bytes / (k // 8 * n * 4))))
        groups = k // gs
        dense_w, sparse_w = [], []
        for _ in range(copies):
            scales = torch.rand(groups, n, dtype=torch.float16, device=dev)
            zeros = torch.rand(groups, n, dtype=torch.float16, device=dev) * 15 if fmt == "uint4" else None
            dense_w.append((torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev), scales,
                            zeros))
            # metadata of valid patterns only: every nibble (0, 1) = 0x4
            sparse_w.append((torch.randint(-2**31, 2**31 - 1, (k // 16, n), dtype=torch.int32, device=dev),
                             torch.full((k // 32, n), 0x44444444, dtype=torch.int32, device=dev), scales, zeros))
        for m in M_VALUES:
            x = torch.randn(m, k, dtype=torch.float16, device=dev)
            it = [0, 0]

            def dense():
                p, s, z = dense_w[it[0] % copies]
                it[0] += 1
                return torch.ops.marlin.gemm(x, p, s, z, None, fmt, gs)

            def sparse():
                v, md, s, z = sparse_w[it[1] % copies]
                it[1] += 1
                return torch.ops.marlin.sparse24_gemm(x, v, md, s, z, None, fmt, gs)

            t_d, t_s = _median_ms(dense), _median_ms(sparse)
            print(f"{name:24} {m:5d} {t_d:8.3f} {t_s:8.3f} {t_d / t_s:6.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="fp4", choices=WEIGHT_FORMATS)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--plan-only", action="store_true", help="only the plan traffic report")
    ap.add_argument("--sparse", action="store_true", help="2:4 sparse against dense of the same format")
    args = ap.parse_args()
    if args.sparse:
        report_sparse_plans(args.format, args.group_size)
    else:
        report_plans(args.format, args.group_size)
    mps = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    if mps and not args.plan_only:
        if not torch._C._dispatch_has_kernel_for_dispatch_key("marlin::gemm", "MPS"):
            print("torch_marlin was built without the MPS bridge: no device timings")
            return
        (bench_sparse_device if args.sparse else bench_device)(args.format, args.group_size)
    elif not mps:
        print("(no MPS device: device timings skipped)")


if __name__ == "__main__":
    main()
