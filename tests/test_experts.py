"""The expert-stack layout and torch.ops.marlin.moe_gemm on CPU against float64 references."""

import os

import pytest
import torch

import torch_marlin as tm
from torch_marlin import formats
from torch_marlin.layouts import QuantizedExperts

from reference import dequantize_one_by_one, pack_one_by_one
from test_ops import EPS

DTYPES = formats.ACTIVATION_DTYPES


def random_stack(experts, k, n, weight_format, group_size):
    groups = 1 if group_size == -1 else k // group_size
    codes = torch.randint(0, 16, (experts, k, n))
    scales = (torch.rand(experts, groups, n) * 0.02 + 0.001).half()
    zeros = (torch.rand(experts, groups, n) * 15).half() if formats.has_zeros(weight_format) else None
    return QuantizedExperts.from_codes(codes, scales, zeros, weight_format, group_size)


def moe_reference(x, ids, weights, b64, bias):
    """float64 routed matmul: b64 [E, K, N] (B = W^T per expert)."""
    x64 = x.double() if x.dim() == 3 else x.double().unsqueeze(1).expand(-1, ids.shape[1], -1)
    y = torch.einsum("tjk,tjkn->tjn", x64, b64[ids.long()])
    mag = torch.einsum("tjk,tjkn->tjn", x64.abs(), b64[ids.long()].abs())
    if bias is not None:
        y, mag = y + bias.double()[ids.long()], mag + bias.double().abs()[ids.long()]
    if weights is None:
        return y, mag
    w = weights.double().unsqueeze(-1)
    return (w * y).sum(1), (w.abs() * mag).sum(1)


def assert_moe_close(out, x, ids, weights, q, bias):
    b64 = torch.stack([formats.dequantize_reference(q.packed[e], q.scales[e],
                                                    None if q.zeros is None else q.zeros[e],
                                                    q.weight_format, q.group_size, torch.float64)
                       for e in range(q.num_experts)])
    ref, mag = moe_reference(x, ids, weights, b64, bias)
    assert out.dtype == x.dtype and out.shape == ref.shape, (out.shape, ref.shape)
    bound = 0.5 * EPS[out.dtype] * ref.abs() + 2e-6 * mag + 1e-30
    err = (out.double() - ref).abs()
    assert torch.all(err <= bound), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


def run(x, ids, weights, q, bias):
    return torch.ops.marlin.moe_gemm(x, ids, weights, q.packed, q.scales, q.zeros, bias, q.weight_format,
                                     q.group_size)


# --- layout -------------------------------------------------------------------------

@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_stack_matches_per_element_reference(weight_format):
    codes = torch.randint(0, 16, (3, 64, 5))
    scales = (torch.rand(3, 2, 5) * 0.02 + 0.001).half()
    zeros = (torch.rand(3, 2, 5) * 15).half() if formats.has_zeros(weight_format) else None
    q = QuantizedExperts.from_codes(codes, scales, zeros, weight_format, 32)
    w = q.dequantize(torch.float64)
    assert w.shape == (3, 5, 64)
    for e in range(3):
        words = pack_one_by_one(codes[e].tolist())
        assert words == q.packed[e].tolist()
        ref = dequantize_one_by_one(words, scales[e].double().tolist(),
                                    None if zeros is None else zeros[e].double().tolist(), weight_format, 32)
        assert torch.equal(w[e].t(), torch.tensor(ref, dtype=torch.float64))
        assert torch.equal(q.expert(e).dequantize(torch.float64), w[e])
        assert torch.equal(tm.unpack_codes(q.packed[e]), codes[e].to(torch.uint8))
    assert torch.allclose(q.weight(torch.float64), w, rtol=0, atol=1e-6 * float(w.abs().max()))
    assert q.descriptor() == [2, formats.WEIGHT_FORMATS.index(weight_format), 32, 64, 3]
    assert q.nbytes == 3 * (64 // 8 * 5 * 4 + 2 * 5 * 2 * (2 if formats.has_zeros(weight_format) else 1))
    with pytest.raises(ValueError, match=r"scales must be \[E, G, N\] with E = 3"):
        QuantizedExperts.from_codes(codes, scales[:2], zeros, weight_format, 32)


def test_stack_of_dense_weights_and_its_errors():
    parts = [tm.quantize_weight(torch.randn(6, 40), "int4", 32) for _ in range(4)]
    q = QuantizedExperts.stack(parts)
    assert (q.num_experts, q.in_features, q.out_features, q.padded_in_features) == (4, 40, 6, 64)
    for e, part in enumerate(parts):
        assert torch.equal(q.expert(e).dequantize(), part.dequantize())
    with pytest.raises(ValueError, match="expert 1 has"):
        QuantizedExperts.stack([parts[0], tm.quantize_weight(torch.randn(6, 40), "fp4", 32)])
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        QuantizedExperts.empty(8, 8, "fp4", 32, num_experts=0)


def test_quantize_experts_equals_quantize_weight_per_expert():
    w = torch.randn(3, 24, 100)
    q = tm.quantize_experts(w, "uint4", 32, method="absmax")
    for e in range(3):
        one = tm.quantize_weight(w[e], "uint4", 32, method="absmax")
        assert torch.equal(q.packed[e], one.packed) and torch.equal(q.scales[e], one.scales)
        assert torch.equal(q.zeros[e], one.zeros)
    assert 0 < q.relative_error < 0.2


# --- the op -------------------------------------------------------------------------

# (E, K, N, T, top_k): decode (GEMV per pair), prefill (expert GEMMs), odd sizes.
SHAPES = [(5, 256, 72, 1, 2), (3, 128, 65, 3, 3), (6, 256, 33, 9, 2), (3, 256, 130, 40, 2)]


@pytest.mark.parametrize("group_size", formats.GROUP_SIZES)
@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_moe_gemm_matches_float64_reference(weight_format, group_size):
    # Every shape in every activation dtype across the group sizes (the dtype
    # handling itself is the dense op's, tested there exhaustively).
    for i, (e, k, n, t, top_k) in enumerate(SHAPES):
        if group_size > 0 and k % group_size:
            continue
        dtype = DTYPES[(i + formats.GROUP_SIZES.index(group_size)) % len(DTYPES)]
        q = random_stack(e, k, n, weight_format, group_size)
        ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(t)])
        bias = torch.randn(e, n).to(dtype) if i % 2 else None
        weights = torch.rand(t, top_k)
        x = torch.randn(t, k).to(dtype)
        assert_moe_close(run(x, ids, weights, q, bias), x, ids, weights, q, bias)
        assert_moe_close(run(x, ids, None, q, bias), x, ids, None, q, bias)
        xp = torch.randn(t, top_k, k).to(dtype)  # one row per (token, expert): the second projection
        assert_moe_close(run(xp, ids.int(), weights.to(dtype), q, bias), xp, ids, weights.to(dtype), q, bias)


@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_moe_gemm_routing_edge_cases(weight_format):
    e, k, n = 7, 128, 40  # E not a power of two
    q = random_stack(e, k, n, weight_format, 64)
    bias = torch.randn(e, n)
    cases = {
        "experts without tokens": torch.tensor([[0, 3], [3, 0], [0, 3]]),
        "all tokens on one expert": torch.full((300, 1), 4),  # 300 rows: several row blocks of one GEMM
        "top_k = 1": torch.randint(0, e, (20, 1)),
        "top_k = E": torch.stack([torch.randperm(e) for _ in range(11)]),
        "T = 1": torch.tensor([[6, 2]]),
        "repeated expert in a token": torch.tensor([[1, 1], [2, 1]]),
    }
    for name, ids in cases.items():
        t, top_k = ids.shape
        x = torch.randn(t, k)
        weights = torch.softmax(torch.randn(t, top_k), -1)
        assert_moe_close(run(x, ids, weights, q, bias), x, ids, weights, q, bias)
        assert_moe_close(run(x, ids, None, q, None), x, ids, None, q, None)


def test_moe_gemm_empty_input():
    q = random_stack(3, 64, 8, "fp4", 32)
    ids = torch.zeros(0, 2, dtype=torch.long)
    assert run(torch.randn(0, 64), ids, torch.rand(0, 2), q, None).shape == (0, 8)
    assert run(torch.randn(0, 64), ids, None, q, None).shape == (0, 2, 8)
    assert run(torch.randn(0, 2, 64).half(), ids, None, q, None).dtype == torch.float16


def test_moe_gemm_equals_dense_gemm_per_pair():
    # The same kernels as the dense op: bit-identical rows (fp32 accumulation, one rounding).
    q = random_stack(4, 512, 96, "int4", 128)
    ids = torch.tensor([[2, 0], [1, 2]])
    x = torch.randn(2, 512, dtype=torch.bfloat16)
    y = run(x, ids, None, q, None)
    for t in range(2):
        for j in range(2):
            e = int(ids[t, j])
            dense = torch.ops.marlin.gemm(x[t:t + 1], q.packed[e], q.scales[e], None, None, "int4", 128)
            assert torch.equal(y[t, j], dense[0])


@pytest.mark.skipif(os.environ.get("TORCH_MARLIN_CPU_KERNELS") == "generic", reason="already the portable build")
def test_portable_kernels_match_reference(child_pytest):
    """The build without AVX2 (aarch64, older x86), forced by environment variable."""
    env = dict(os.environ, TORCH_MARLIN_CPU_KERNELS="generic")
    tests = ["test_moe_gemm_matches_float64_reference and fp4-32", "test_moe_gemm_matches_float64_reference and uint4-64",
             "test_moe_gemm_routing_edge_cases and int4"]
    returncode, output = child_pytest("test_experts.py reference tests under the generic build",
                                      [__file__, "-k", " or ".join(f"({t})" for t in tests)], env, timeout=600)
    assert returncode == 0, output[-6000:]
    assert " passed" in output and " failed" not in output


# --- bad input ----------------------------------------------------------------------

def test_moe_gemm_bad_input_names_the_argument():
    q = random_stack(4, 64, 8, "uint4", 32)
    x, ids, w, bias = torch.randn(3, 64), torch.randint(0, 4, (3, 2)), torch.rand(3, 2), torch.randn(4, 8)

    def call(**kw):
        args = dict(x=x, expert_ids=ids, topk_weights=w, packed=q.packed, scales=q.scales, zeros=q.zeros,
                    bias=bias, weight_format="uint4", group_size=32)
        args.update(kw)
        return torch.ops.marlin.moe_gemm(**args)

    bad = [
        (dict(expert_ids=torch.tensor([[0, 4], [1, 2], [3, 3]])), IndexError, r"expert_ids\[0, 1\] = 4.*|\[0, 4\)"),
        (dict(expert_ids=torch.tensor([[0, 1], [-1, 2], [3, 3]])), IndexError, r"expert_ids\[1, 0\] = -1"),
        (dict(expert_ids=ids.float()), RuntimeError, "expert_ids must be int32 or int64"),
        (dict(expert_ids=ids[0]), RuntimeError, r"expert_ids must have shape \[T, top_k\]"),
        (dict(topk_weights=torch.rand(3, 3)), RuntimeError, "topk_weights must have expert_ids' shape"),
        (dict(topk_weights=torch.rand(2, 2)), RuntimeError, "topk_weights must have expert_ids' shape"),
        (dict(topk_weights=w.long()), RuntimeError, "topk_weights must be float16, bfloat16 or float32"),
        (dict(x=x.long()), RuntimeError, "x must be float16, bfloat16 or float32"),
        (dict(x=torch.randn(4, 64)), RuntimeError, r"x must be \[T, K\] or \[T, top_k, K\]"),
        (dict(x=torch.randn(3, 3, 64)), RuntimeError, r"x must be \[T, K\] or \[T, top_k, K\]"),
        (dict(x=torch.randn(3, 32)), RuntimeError, "x.size.-1. must equal K = 8 . packed.size.1. = 64"),
        (dict(x=x.to("meta")), RuntimeError, "x must be on the same device as packed"),
        (dict(bias=torch.randn(3, 8)), RuntimeError, r"bias must have shape \[E, N\] = \[4, 8\]"),
        (dict(bias=bias.half()), RuntimeError, "bias must have x's dtype"),
        (dict(scales=q.scales[:3]), RuntimeError, r"scales must have shape \[E, K/group_size, N\] = \[4, 2, 8\]"),
        (dict(zeros=None), ValueError, "zeros is required"),
        (dict(packed=q.packed[0]), RuntimeError, r"packed must be 3-D \[E, K/8, N\]"),
        (dict(weight_format="int8"), ValueError, "weight_format"),
        (dict(group_size=48), ValueError, "group_size"),
    ]
    for kwargs, exc, match in bad:
        with pytest.raises(exc, match=match):
            call(**kwargs)
