"""GPTQ for one linear layer: quantize W [N, K] given the Hessian H = E[x x^T] [K, K] of its inputs.

The objective is the layer's output error on the calibration inputs,
tr((W - Q) H (W - Q)^T). GPTQ (Frantar et al., 2022) quantizes the columns of W
one at a time and moves each column's rounding error onto the columns not yet
quantized, through the Cholesky factor of H^-1; the updates are applied in
blocks of `block_size` columns (the "lazy batch" form). On top of that:

- Group scales are searched when GPTQ reaches a group's first column, on the
  already-updated weights, minimizing the error weighted by each column's GPTQ
  cost 1 / U[k, k]^2 (U = chol(H^-1)) rather than the plain squared error.
- Refinement (`refine_rounds`, default 1): with the codes fixed, every row's
  group scales (and zero points) are refit jointly by least squares on the
  full objective, then GPTQ runs again with those scales fixed. Of all the
  solutions seen, the one with the smallest objective is kept, so refinement
  never makes the result worse on the calibration data.
- `act_order` quantizes columns by decreasing H[k, k]. The weight is stored in
  that order, so each group is a contiguous block of K for the existing
  kernels, and `input_perm` says how to permute the input
  (y = x[..., input_perm] @ Wq^T). With group_size=-1 the order does not
  matter for the layout and the weight is stored in the original order.
- `damp` adds damp * mean(diag H) to the diagonal (more if H is still not
  positive definite; the value used is reported). Columns whose input is
  always zero (H[k, k] = 0) are rounded to nearest and carry no error along.

Everything is deterministic: no random numbers, fixed operation order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import formats
from .calibration import DEFAULT_BLOCK_SIZE, DEFAULT_DAMP
from .quantize import CalibratedMethod, QuantizedCodes, _to_fp16_scale, _values, register_calibrated_method

DEFAULT_REFINE_ROUNDS = 1
_CLIP_RATIOS = torch.linspace(1.0, 0.6, 21).tolist()
_SEARCH_REFITS = 2
_MAX_DAMP = 1.0  # relative damping beyond which H is considered unusable
_REFIT_CHUNK_ELEMENTS = 1 << 24  # bounds the [rows, K, G] temporary of the scale refit
_INNER_BLOCK = 32


@dataclass
class GPTQResult:
    qweight: object  # the codes packed in the dense layout (QuantizedWeight); K in act order when input_perm is set
    input_perm: Optional[torch.Tensor]  # int32 [in_features] or None
    relative_output_error: float  # sqrt(tr(E H E^T) / tr(W H W^T)) on the given H
    damp: float  # relative damping actually used


def check_hessian(hessian, in_features: int, name: str = "hessian") -> torch.Tensor:
    """A finite, square [K, K] floating-point tensor; returned as float64 on the CPU."""
    if not isinstance(hessian, torch.Tensor) or not hessian.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor [in_features, in_features], "
                        f"got {formats._describe(hessian)}")
    if tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(f"{name} must have shape [in_features, in_features] = [{in_features}, {in_features}], "
                         f"got {list(hessian.shape)}")
    h = hessian.detach().to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(h).all():
        raise ValueError(f"{name} contains NaN or Inf")
    if (torch.diagonal(h) < 0).any():
        raise ValueError(f"{name} has negative diagonal entries: not a Hessian X^T X of inputs")
    return (h + h.t()).mul_(0.5)


def check_options(weight_format: str, group_size: int, act_order: bool = False, damp: float = DEFAULT_DAMP,
                  block_size: int = DEFAULT_BLOCK_SIZE, refine_rounds: int = DEFAULT_REFINE_ROUNDS) -> None:
    formats.check_weight_format(weight_format)
    formats.check_group_size(group_size)
    if not isinstance(act_order, bool):
        raise TypeError(f"act_order must be a bool, got {act_order!r}")
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 <= damp <= _MAX_DAMP:
        raise ValueError(f"damp must be a number in [0, {_MAX_DAMP}], got {damp!r}")
    for arg, value, low in (("block_size", block_size, 1), ("refine_rounds", refine_rounds, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, weight_format: str = "fp4",
                  group_size: int = 128, act_order: bool = False, damp: float = DEFAULT_DAMP,
                  block_size: int = DEFAULT_BLOCK_SIZE,
                  refine_rounds: int = DEFAULT_REFINE_ROUNDS) -> GPTQResult:
    """Quantize weight [N, K] minimizing tr((W - Q) H (W - Q)^T); see the module docstring."""
    check_options(weight_format, group_size, act_order, damp, block_size, refine_rounds)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a 2-D floating-point tensor [N, K], got {formats._describe(weight)}")
    if weight.numel() == 0:
        raise ValueError(f"weight must not be empty, got shape {list(weight.shape)}")
    n, k = weight.shape
    h = check_hessian(hessian, k)
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN or Inf (in float32)")

    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w, h = w[:, perm], h[perm][:, perm]
    kp = formats.padded_in_features(k, group_size)
    gs = formats.effective_group_size(kp, group_size)
    if kp != k:  # padded columns: zero weights, zero inputs
        w = torch.nn.functional.pad(w, (0, kp - k))
        h = torch.nn.functional.pad(h, (0, kp - k, 0, kp - k))
    u, used_damp, added = _inverse_cholesky(h, damp)
    cost = torch.diagonal(u).pow(-2).float()  # GPTQ's cost per unit squared error of each column
    cost[k:] = 0  # padding meets zero inputs
    problem = _Problem(w, h, u, cost, weight_format, gs, block_size, added)
    del h, u

    best = problem.run(None)
    for _ in range(refine_rounds):
        refit = problem.refit_scales(best)
        candidate = problem.run(refit)
        for option in (refit, candidate):
            if option.loss < best.loss:
                best = option

    codes, scales, zeros = best.codes, best.scales, best.zeros
    if perm is not None and group_size == -1:  # one group per row: store in the original order
        inverse = torch.argsort(perm)
        codes = torch.cat([codes[:, :k][:, inverse], codes[:, k:]], dim=1)
        perm = None
    deq = _dequantize(best.codes, best.scales, best.zeros, weight_format, gs)
    norm = float(problem.w.norm())
    error = float((problem.w - deq).norm()) / norm if norm > 0 else 0.0
    q = QuantizedCodes("dense", codes.t(), scales.t(), None if zeros is None else zeros.t(), weight_format,
                       group_size, k, n, error)
    reference = float((problem.hw * problem.w).sum(dtype=torch.float64))  # tr(W H W^T)
    rel_out = math.sqrt(best.loss / reference) if reference > 0 else 0.0
    return GPTQResult(q.pack(), None if perm is None else perm.to(torch.int32), rel_out, used_damp)


# --- internals -------------------------------------------------------------------------

@dataclass
class _Solution:
    codes: torch.Tensor  # uint8 [N, Kp]
    scales: torch.Tensor  # fp16 [N, G]
    zeros: Optional[torch.Tensor]  # fp16 [N, G] (uint4)
    loss: float  # tr(E H E^T)


def _block_columns(block_size: int, group_size: int, k: int) -> int:
    """Block size rounded up to whole groups, so a group's search sees its updated columns;
    a single group over all of K is searched up front instead."""
    if group_size == k:
        return block_size
    return -(-block_size // group_size) * group_size


def _inverse_cholesky(h: torch.Tensor, damp: float) -> Tuple[torch.Tensor, float, torch.Tensor]:
    """Upper Cholesky factor U of (H + diag(added))^-1 with added = damp * mean(diag H) (plus the
    mean itself where H[k, k] = 0); raises damping until it works. Returns (U, damp, added)."""
    diag = torch.diagonal(h).clone()
    dead = diag <= 0
    mean = float(diag[~dead].mean()) if (~dead).any() else 1.0
    diag[dead] = mean  # inputs never seen: plain rounding, no error carried to other columns
    used = damp
    while True:
        damped = h.clone()
        damped.diagonal().copy_(diag + used * mean)
        lower, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) == 0:
            hinv = torch.cholesky_inverse(lower)
            del lower
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                return upper, used, diag + used * mean - torch.diagonal(h)
        if used >= _MAX_DAMP:
            raise ValueError("the Hessian is not positive definite even with damp=1.0; "
                             "the calibration inputs are degenerate")
        used = min(_MAX_DAMP, max(used * 10, 1e-4))


class _Problem:
    """GPTQ passes on padded (and permuted) w [N, Kp] with upper Cholesky factor u of H^-1.
    Runs in w's dtype (float32; the tests use float64)."""

    def __init__(self, w, h, u, cost, weight_format, group_size, block, added):
        self.w, self.h, self.u = w, h.to(w.dtype), u.to(w.dtype)
        self.added = added.to(w.dtype)  # what the damping added to diag(H)
        self._hw = None
        self.cost = cost  # float32 [Kp]
        self.fmt, self.gs = weight_format, group_size
        self.block = _block_columns(block, group_size, w.shape[1])
        # Rank-1 updates inside blocks of this many columns, matrix products between them:
        # a divisor or a multiple of the group size, so each group's search sees every update.
        self.inner = min(_INNER_BLOCK, self.block) if group_size % _INNER_BLOCK == 0 or group_size > self.block \
            else group_size

    @property
    def hw(self) -> torch.Tensor:
        """w @ H [N, Kp], computed once."""
        if self._hw is None:
            self._hw = self.w @ self.h
        return self._hw

    def loss_of(self, dequantized: torch.Tensor) -> float:
        """tr(E H E^T), E = w - dequantized: one [N, K] x [K, K] product."""
        e = self.w - dequantized.to(self.w.dtype)
        return float(((e @ self.h) * e).sum(dtype=torch.float64))

    def gptq_loss(self, squared_errors: float, dequantized: torch.Tensor) -> float:
        """tr(E H E^T) of a GPTQ pass without the product: the pass's scaled errors
        sum to tr(E (H + diag(added)) E^T) exactly, so subtract the damping's part."""
        e = self.w - dequantized.to(self.w.dtype)
        return squared_errors - float((e * e * self.added).sum(dtype=torch.float64))

    def run(self, fixed: Optional[_Solution]) -> _Solution:
        """One GPTQ pass; group scales searched on the fly, or taken from `fixed`."""
        w = self.w.clone()
        n, kp = w.shape
        gs, fmt, u = self.gs, self.fmt, self.u
        groups = kp // gs
        values = torch.empty(n, kp, dtype=w.dtype)
        deq = torch.empty(n, kp, dtype=w.dtype)
        if fixed is None:
            scales = torch.empty(n, groups, dtype=torch.float16)
            zeros = torch.empty_like(scales) if formats.has_zeros(fmt) else None
        else:
            scales, zeros = fixed.scales, fixed.zeros
        search_per_group = fixed is None and gs <= self.block
        if fixed is None and not search_per_group:  # one group over all of K
            scales[:, 0], z = _weighted_search(w, self.cost, fmt)
            if zeros is not None:
                zeros[:, 0] = z
        squared_errors = 0.0
        for i1 in range(0, kp, self.block):
            i2 = min(i1 + self.block, kp)
            err = torch.empty(n, i2 - i1, dtype=w.dtype)
            for j1 in range(i1, i2, self.inner):
                j2 = min(j1 + self.inner, i2)
                w1 = w[:, j1:j2]  # a view: updated in place
                u1 = u[j1:j2, j1:j2]
                for i in range(j2 - j1):
                    col = j1 + i
                    if col % gs == 0:
                        g = col // gs
                        if search_per_group:
                            s, z = _weighted_search(w[:, col:col + gs], self.cost[col:col + gs], fmt)
                            scales[:, g] = s
                            if zeros is not None:
                                zeros[:, g] = z
                        s = scales[:, g].to(w.dtype)
                        z = None if zeros is None else zeros[:, g].to(w.dtype)
                    v, d = _quantize_column(w1[:, i], s, z, fmt)
                    values[:, col], deq[:, col] = v, d
                    e = (w1[:, i] - d) / u1[i, i]
                    w1[:, i:].addr_(e, u1[i, i:], alpha=-1)
                    err[:, col - i1] = e
                if j2 < i2:
                    w[:, j2:i2].addmm_(err[:, j1 - i1:j2 - i1], u[j1:j2, j2:i2], alpha=-1)
            if i2 < kp:
                w[:, i2:].addmm_(err, u[i1:i2, i2:], alpha=-1)
            squared_errors += float((err * err).sum(dtype=torch.float64))
        return _Solution(_codes_of(values, fmt), scales.clone(), None if zeros is None else zeros.clone(),
                         self.gptq_loss(squared_errors, deq))

    def refit_scales(self, sol: _Solution) -> _Solution:
        """Least-squares group scales (and zeros) for fixed codes on the full objective."""
        n, kp = self.w.shape
        gs, groups = self.gs, kp // self.gs
        uint4 = sol.zeros is not None  # or any format with zeros
        bias = formats.value_format(self.fmt).bias
        # uint4: w = s (q - z) = s (q - 8) + c per group, with c = s (8 - z) (affine: w = s q + b,
        # c = 8 s + b): centered codes keep the two terms from cancelling (and the float32
        # products accurate).
        offset_term = lambda s, z: formats.INT4_OFFSET * s + z if bias else (formats.INT4_OFFSET - z) * s
        values = formats.code_values(sol.codes, self.fmt).to(self.w.dtype)
        if uint4:
            values -= formats.INT4_OFFSET
        hw = self.hw
        hg = self.h.view(kp, groups, gs)
        # c-terms (uint4): sum of H over each pair of groups, and H summed over l in group h.
        h_row_groups = hg.sum(-1)  # [Kp, G]: sum_{l in h} H[k, l]
        h_groups = h_row_groups.view(groups, gs, groups).sum(1)  # [G, G]
        scales = sol.scales.clone()
        zeros = None if sol.zeros is None else sol.zeros.clone()
        loss = 0.0
        rows = max(1, _REFIT_CHUNK_ELEMENTS // (kp * groups))
        for r0 in range(0, n, rows):
            v = values[r0:r0 + rows]  # [R, Kp]
            r = v.shape[0]
            vg = v.view(r, groups, gs)
            # t[r, k, h] = sum_{l in h} H[k, l] v[r, l]
            t = torch.einsum("rhl,khl->rkh", vg, hg)
            # The products in the working dtype, the small [G, G] solves in float64.
            a = torch.einsum("rgk,rgkh->rgh", vg, t.view(r, groups, gs, groups)).double()  # [R, G, G]
            rhs = (vg * hw[r0:r0 + rows].view(r, groups, gs)).sum(-1).double()  # [R, G]
            old_s = sol.scales[r0:r0 + rows].double()
            if uint4:
                b = torch.einsum("rgk,gkh->rgh", vg, h_row_groups.view(groups, gs, groups)).double()
                corner = h_groups.double().expand(r, -1, -1)
                a = torch.cat([torch.cat([a, b], 2), torch.cat([b.transpose(1, 2), corner], 2)], 1)
                rhs = torch.cat([rhs, hw[r0:r0 + rows].view(r, groups, gs).sum(-1).double()], 1)
                old = torch.cat([old_s, offset_term(old_s, sol.zeros[r0:r0 + rows].double())], 1)
            else:
                old = old_s
            # A small ridge toward the current values keeps groups without information
            # (all codes zero, dead inputs) where they are.
            ridge = torch.diagonal(a, dim1=1, dim2=2).mean(-1, keepdim=True).clamp_min(1e-30) * 1e-6
            lhs = a + torch.diag_embed(ridge.expand(-1, a.shape[-1]))
            x = torch.linalg.solve(lhs, (rhs + ridge * old).unsqueeze(-1)).squeeze(-1)
            new_s = x[:, :groups]
            ok = torch.isfinite(new_s) & (new_s > 0)
            scales[r0:r0 + rows] = torch.where(ok, _to_fp16_scale(new_s.float()), sol.scales[r0:r0 + rows])
            s16 = scales[r0:r0 + rows].double()
            stored = s16
            if uint4:
                c = x[:, groups:]
                new_z = (c - formats.INT4_OFFSET * s16 if bias else formats.INT4_OFFSET - c / s16).clamp(-65504, 65504)
                zeros[r0:r0 + rows] = torch.where(ok & torch.isfinite(new_z), new_z.half(), sol.zeros[r0:r0 + rows])
                stored = torch.cat([s16, offset_term(s16, zeros[r0:r0 + rows].double())], 1)
            # The objective of the values as stored (fp16), per row: w'Hw - 2 x'r + x'Ax.
            whw = (hw[r0:r0 + rows] * self.w[r0:r0 + rows]).sum(-1).double()
            quadratic = (stored.unsqueeze(1) @ a @ stored.unsqueeze(-1)).view(-1)
            loss += float((whw - 2 * (stored * rhs).sum(-1) + quadratic).sum())
        return _Solution(sol.codes, scales, zeros, loss)


def _dequantize(codes, scales, zeros, weight_format, group_size) -> torch.Tensor:
    """codes [N, K], scales/zeros [N, G] -> float32 [N, K]."""
    per_column = lambda t: None if t is None else t.float().repeat_interleave(group_size, dim=1)
    return formats.value_format(weight_format).weights(formats.code_values(codes, weight_format),
                                                       per_column(scales), per_column(zeros))


def _quantize_column(w: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], weight_format: str):
    """(code value before the scale -- q itself for formats with zeros --, dequantized value) of one column."""
    fmt = formats.value_format(weight_format)
    v = fmt.nearest_values(fmt.code_inputs(w, scale, zero))
    return v, fmt.weights(v, scale, zero)


def _codes_of(values: torch.Tensor, weight_format: str) -> torch.Tensor:
    """uint8 codes of exact code values (q for formats with zeros)."""
    return formats.value_format(weight_format).codes_of(values)


def _weighted_search(group: torch.Tensor, cost: torch.Tensor, weight_format: str):
    """Scale (and zero) for each row of group [N, gs] minimizing sum_k cost[k] (w - q)^2
    (cost [gs], or [N, gs]: one per weight, as SparseGPT's kept weights): clipped ranges,
    each refit by weighted least squares on its codes."""
    c = cost.float()
    c = (c.unsqueeze(0) if c.dim() == 1 else c) + 1e-30
    group = group.float()
    n = group.shape[0]
    best_err = torch.full((n,), float("inf"))
    best_s = torch.empty(n, dtype=torch.float16)
    fmt = formats.value_format(weight_format)
    best_z = torch.zeros(n, dtype=torch.float16) if fmt.zeros else None
    if fmt.zeros:
        lo, hi = group.amin(-1).clamp(max=0), group.amax(-1).clamp(min=0)
        qmax = fmt.value_range
    else:
        lo, hi = None, group.abs().amax(-1)
        qmax = fmt.max_value
    csum = c.sum(-1, keepdim=True)
    for ratio in _CLIP_RATIOS:
        if lo is None:
            s = _to_fp16_scale(hi * ratio / qmax)
            z = None
        else:
            s = _to_fp16_scale((hi - lo) * ratio / qmax)
            z = (lo * ratio).clamp(-65504, 65504).half() if fmt.bias else (-lo * ratio / s.float()).half()
        for refit in range(_SEARCH_REFITS):
            if z is None:
                v = _values(group, s, None, weight_format)
                d = v * s.float().unsqueeze(-1) - group
            else:  # q, and the weights it stands for
                s1, z1 = s.float().unsqueeze(-1), z.float().unsqueeze(-1)
                q = fmt.nearest_values(fmt.code_inputs(group, s1, z1))
                d = fmt.weights(q, s1, z1) - group
            err = (d * d * c).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, s, best_s)
            if z is not None:
                best_z = torch.where(better, z, best_z)
            if refit == _SEARCH_REFITS - 1:
                break
            if z is None:  # argmin_s sum c (v s - w)^2
                vv = (c * v * v).sum(-1)
                new = (c * v * group).sum(-1) / vv.clamp_min(1e-30)
                s = _to_fp16_scale(torch.where(vv > 0, new, s.float()))
            else:  # weighted fit w ~ a q + b on these codes; zero = -b / a (a bias: b)
                qm = (c * q).sum(-1, keepdim=True) / csum
                wm = (c * group).sum(-1, keepdim=True) / csum
                qc = q - qm
                var = (c * qc * qc).sum(-1)
                a = (c * qc * (group - wm)).sum(-1) / var.clamp_min(1e-30)
                ok = (var > 0) & (a > 2.0 ** -14)
                s_new = _to_fp16_scale(torch.where(ok, a, s.float()))
                b = wm.squeeze(-1) - a * qm.squeeze(-1)
                z = torch.where(ok, b if fmt.bias else -b / s_new.float(), z.float()).clamp(-65504, 65504).half()
                s = s_new
    return best_s, best_z


register_calibrated_method("gptq", CalibratedMethod("GPTQ", "round to nearest", None, check_options, gptq_quantize))
