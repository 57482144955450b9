"""Quantizers of the entropy-coded layout (docs/ENTROPY.md).

- Lossless (`entropy_code=True`): the codes of a dense 4-bit weight, entropy-coded
  (RansQuantizedWeight.from_dense); decoding gives the identical codes.
- Rate-controlled grid (`bits=<float>`): every weight on a uniform grid q * step[n]
  (q in -127..127, one fp16 step per output row), coded with one frequency table per
  layer. `bits` is the average over the quantized layers with every byte of their
  weights counted (words, offsets, states, table, steps).

The allocation is the Lagrangian one: every layer minimises D_l + lambda * R_l at one
common lambda (equal slope), and lambda is searched so that sum R_l meets the budget.
D_l is the layer's relative squared weight error ||W - Wq||^2 / ||W||^2 (GPTQ: measured
through its Hessian), R_l its size in bits. For a given lambda a layer's step follows
from the high-rate slope of a uniform quantizer (dD/dR = -2 ln2 D) and is refined over
a few multipliers; rounding is rate-aware: a weight moves to the neighbouring grid point
when (w - q step)^2 / ||W||^2 + lambda * bits(q) is smaller there, bits(q) = -log2 of the
symbol's coded probability (two passes: the table of the previous pass). Round to
nearest then refits each row's step to its codes by least squares and rounds again
(REFIT_STEPS times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch

from . import rans
from .layouts.rans import GRID, RansQuantizedWeight

MAX_Q = 127  # |q| bound of the quantizers (symbols 1..255)
STEP_MULTIPLIERS = (0.85, 1.0, 1.15)  # around the high-rate step of a lambda
RDO_PASSES = 2
REFIT_STEPS = 3  # round-to-nearest rounds again after refitting the steps: docs/ENTROPY.md
ROW_POWER = 1.0  # step of row n ~ rms(row)^ROW_POWER: measured in docs/ENTROPY.md
RATE_AWARE = False  # rate-aware rounding by default: measured in docs/ENTROPY.md
WEIGHTING = "weight"
# "layer": every layer's relative error ||W - Wq||^2 / ||W||^2 counts once; "weight":
# it counts once per weight (the same relative step everywhere). Measured: docs/ENTROPY.md.
WEIGHTINGS = ("layer", "weight")
_SEARCH_WEIGHTS = 1 << 18  # rows sampled per layer while searching lambda
_TINY = 2.0 ** -24


def check_bits(bits) -> float:
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not math.isfinite(bits) or not 1.0 <= bits <= 8.0:
        raise ValueError(f"bits must be a number of bits per weight in [1, 8], got {bits!r}")
    return float(bits)


def overhead_bytes(k: int, n: int, chunk_k: int, alphabet: int = rans.ALPHABET_GRID, scale_rows: int = 1) -> int:
    """Bytes of a coded weight besides its words: states, offsets, table, fp16 scales."""
    n_chunks = rans.num_blocks(n) * rans.num_kchunks(k, chunk_k)
    return 4 * rans.LANES * n_chunks + 4 * (n_chunks + 1) + 2 * alphabet + 2 * scale_rows * n


def symbol_bits(counts: torch.Tensor, prob_bits: int) -> torch.Tensor:
    """Coded bits of each symbol under the table rans would build from `counts` (float32 [S]);
    unused symbols cost prob_bits + 1 (a unit of the table would have to move to them)."""
    freqs = torch.from_numpy(rans.normalize_freqs(counts.cpu().numpy(), prob_bits).astype(np.float64))
    bits = prob_bits - torch.log2(freqs.clamp_min(1))
    return torch.where(freqs > 0, bits, torch.full_like(bits, prob_bits + 1)).float()


def ideal_code_bits(counts: torch.Tensor, prob_bits: int) -> float:
    return float((counts.double() * symbol_bits(counts, prob_bits).double()).sum())


def row_steps(w: torch.Tensor, step: float, row_power: float = ROW_POWER) -> torch.Tensor:
    """fp16 steps [N] of one layer: `step` times (rms of the row / rms of the layer)^row_power."""
    rms_row = w.pow(2).mean(1).sqrt()
    rms = float(w.pow(2).mean().sqrt())
    shape = (rms_row / max(rms, _TINY)).clamp_min(1e-3).pow(row_power) if row_power else torch.ones_like(rms_row)
    # Never finer than the row's absmax / 127: no weight is clamped (and sizes fall with lambda).
    finest = w.abs().amax(1) / MAX_Q * (1 + 2.0 ** -10)
    return torch.maximum(step * shape, finest).clamp(2.0 ** -14, 65504.0).half()


def round_rate_aware(y: torch.Tensor, distortion_scale, lam: float, bits: Optional[torch.Tensor]) -> torch.Tensor:
    """q (int16) for y = w / step: floor or ceil, whichever costs less
    distortion_scale * (y - q)^2 + lam * bits[q + 128]; round to nearest without `bits`."""
    if bits is None:
        return torch.round(y).clamp_(-MAX_Q, MAX_Q).to(torch.int16)
    lo = torch.floor(y).clamp_(-MAX_Q, MAX_Q - 1)
    # Going up costs scale * ((1 - f)^2 - f^2) = scale * (1 - 2f) more distortion, f = y - lo,
    # and saves lam * (bits[lo] - bits[lo + 1]).
    saving = (bits[:-1] - bits[1:]).to(y.device) * lam
    up = distortion_scale * (1 - 2 * (y - lo)) < saving[(lo + rans.GRID_OFFSET).long()]
    return lo.add_(up).to(torch.int16)


def symbol_counts(q: torch.Tensor) -> torch.Tensor:
    return torch.bincount((q.reshape(-1).long() + rans.GRID_OFFSET), minlength=rans.ALPHABET_GRID)


@dataclass
class GridResult:
    codes: torch.Tensor  # int16 q [N, K]
    steps: torch.Tensor  # fp16 [N]
    distortion: float  # ||W - Wq||^2 / ||W||^2
    code_bits: float  # ideal coded bits of the codes under their table
    bits_table: torch.Tensor  # coded bits per symbol


def quantize_grid(w: torch.Tensor, step: float, lam: float, prob_bits: int = rans.DEFAULT_PROB_BITS,
                  rate_aware: bool = RATE_AWARE, row_power: float = ROW_POWER) -> GridResult:
    """Round w [N, K] (float32) onto the grid of `step` with rate-aware rounding at `lam`
    (distortion in units of ||W||^2, rate in bits)."""
    norm2 = max(float(w.pow(2).sum()), _TINY)
    steps = row_steps(w, step, row_power)
    s = steps.float().unsqueeze(1)
    y = w / s
    scale = s ** 2 / norm2
    q = round_rate_aware(y, scale, lam, None)
    bits = None
    for _ in range(RDO_PASSES if rate_aware and lam > 0 else 0):
        bits = symbol_bits(symbol_counts(q).float(), prob_bits)
        q = round_rate_aware(y, scale, lam, bits)
    counts = symbol_counts(q)
    table = symbol_bits(counts.float(), prob_bits)
    distortion = float((w - q.float() * s).pow(2).sum()) / norm2
    return GridResult(q, steps, distortion, float((counts.double() * table.double()).sum()), table)


def high_rate_step(lam: float, norm2: float) -> float:
    """Step of a uniform quantizer whose slope dD/dR (D = step^2 / 12 per weight in units of
    norm2, R in bits per weight) equals -lam: lam = 2 ln2 step^2 / (12 norm2)."""
    return math.sqrt(6.0 * lam * norm2 / math.log(2.0))


@dataclass
class _Layer:
    name: str
    weight: torch.Tensor  # float32 [N, K] (CPU)
    chunk_k: int
    sample: torch.Tensor  # rows used while searching lambda
    fraction: float  # N / sampled rows
    norm2: float
    overhead_bits: float
    importance: float  # weight of its relative error in the total distortion
    choice: Dict[float, float] = field(default_factory=dict)  # lambda -> step

    @property
    def num_weights(self) -> int:
        return self.weight.numel()


def _layer(name: str, weight: torch.Tensor, chunk_k: Optional[int], weighting: str) -> _Layer:
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if not torch.isfinite(w).all():
        raise ValueError(f"{name}: weight contains NaN or Inf")
    n, k = w.shape
    chunk = default_grid_chunk_k(k) if chunk_k is None else rans.check_chunk_k(chunk_k)
    rows = max(1, min(n, _SEARCH_WEIGHTS // k))
    index = torch.linspace(0, n - 1, rows).round().long().unique()
    importance = 1.0 if weighting == "layer" else float(w.numel())
    return _Layer(name, w, chunk, w[index], n / index.numel(), float(w.pow(2).sum()),
                  8.0 * overhead_bytes(k, n, chunk), importance)


def default_grid_chunk_k(k: int) -> int:
    return min(rans.DEFAULT_CHUNK_K, -(-k // rans.LANES) * rans.LANES)


def _best_on_sample(layer: _Layer, lam: float, prob_bits: int, rate_aware: bool, row_power: float):
    """(bits, step) of the best step multiplier at lambda, measured on the layer's sample.
    Its rounding weighs the error in units of the whole layer's ||W||^2."""
    lam = lam / layer.importance
    sample_norm2 = max(float(layer.sample.pow(2).sum()), _TINY)
    base = high_rate_step(lam, layer.norm2)
    best = None
    for m in STEP_MULTIPLIERS:
        r = quantize_grid(layer.sample, base * m, lam * layer.norm2 / sample_norm2, prob_bits, rate_aware, row_power)
        bits = r.code_bits * layer.fraction + layer.overhead_bits
        cost = r.distortion + lam * bits
        if best is None or cost < best[0]:
            best = (cost, bits, base * m)
    return best[1:]


def _sizes_at(layers: List[_Layer], lam: float, prob_bits: int, rate_aware: bool, row_power: float) -> float:
    total = 0.0
    for layer in layers:
        bits, step = _best_on_sample(layer, lam, prob_bits, rate_aware, row_power)
        layer.choice[lam] = step
        total += bits
    return total


def allocate(layers: List[_Layer], budget_bits: float, prob_bits: int, rate_aware: bool = RATE_AWARE,
             row_power: float = ROW_POWER) -> float:
    """The smallest lambda (on a bisection in log lambda) whose sizes meet budget_bits."""
    floor_bits = sum(layer.overhead_bits for layer in layers)
    if floor_bits >= budget_bits:
        per_weight = floor_bits / sum(layer.num_weights for layer in layers)
        raise ValueError(f"bits is below what these layers' tables, states and steps alone take "
                         f"({per_weight:.3f} bits per weight)")
    size = lambda lam: _sizes_at(layers, lam, prob_bits, rate_aware, row_power)
    lo = hi = 1e-8  # bracket: size(lo) > budget >= size(hi)
    while size(hi) > budget_bits:
        lo, hi = hi, hi * 8
        if hi > 1e6:
            raise ValueError("bits is too low to reach with the grid")
    while lo == hi or size(lo) <= budget_bits:
        if lo < 1e-20:  # even the finest grid fits: use it
            return lo
        hi, lo = lo, lo / 8
    for _ in range(16):
        mid = math.sqrt(lo * hi)
        if size(mid) <= budget_bits:
            hi = mid
        else:
            lo = mid
    return hi


def encode_grid(result: GridResult, chunk_k: int, prob_bits: int) -> RansQuantizedWeight:
    symbols = (result.codes.t() + rans.GRID_OFFSET).to(torch.uint8)
    return RansQuantizedWeight.from_codes(symbols, result.steps.unsqueeze(0).contiguous(), None, GRID, -1,
                                          chunk_k, prob_bits)


# --- GPTQ on the grid ---------------------------------------------------------------------

def gptq_grid(weight: torch.Tensor, hessian: torch.Tensor, steps: torch.Tensor, lam: float,
              bits_table: Optional[torch.Tensor], act_order: bool = False, damp: float = 0.01,
              block_size: int = 128) -> torch.Tensor:
    """GPTQ onto the grid of fixed per-row fp16 `steps` [N]: columns rounded one at a time
    (rate-aware with `bits_table` at `lam`, the column's distortion weighted by its GPTQ cost
    relative to the mean), each column's error spread over the later ones through
    chol(H^-1). Returns int16 q [N, K] in the original column order."""
    from .gptq import _inverse_cholesky, check_hessian

    w = weight.detach().to(device="cpu", dtype=torch.float32).clone()
    n, k = w.shape
    h = check_hessian(hessian, k)
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    u, _, _ = _inverse_cholesky(h, damp)
    u = u.float()
    cost = torch.diagonal(u).pow(-2)
    cost = cost / cost.mean().clamp_min(_TINY)
    s = steps.float().to(w.device)
    norm2 = max(float(weight.float().pow(2).sum()), _TINY)
    q = torch.empty(n, k, dtype=torch.int16)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        block = w[:, i1:i2].clone()
        errors = torch.empty_like(block)
        for j in range(i2 - i1):
            i = i1 + j
            column = block[:, j]
            qi = round_rate_aware(column / s, s ** 2 * float(cost[i]) / norm2, lam, bits_table)
            q[:, i] = qi
            err = (column - qi.float() * s) / u[i, i]
            block[:, j:] -= err.unsqueeze(1) * u[i, i:i2].unsqueeze(0)
            errors[:, j] = err
        w[:, i2:] -= errors @ u[i1:i2, i2:]
    if perm is not None:
        q = q[:, torch.argsort(perm)]
    return q


@dataclass
class _Plan:
    """The round-to-nearest allocation: per layer the step and table at the common lambda."""

    lam: float
    layers: Dict[str, _Layer]
    planned_bits: Dict[str, float]
    budget_bits: float
    prob_bits: int
    rate_aware: bool
    row_power: float
    used_bits: float = 0.0

    def target_bits(self, name: str) -> float:
        """This layer's share of what is left of the budget (in proportion to the plan)."""
        left = sum(bits for other, bits in self.planned_bits.items() if other != name)
        share = self.planned_bits[name] / (self.planned_bits[name] + left)
        return (self.budget_bits - self.used_bits) * share

    def done(self, name: str, qweight: RansQuantizedWeight) -> None:
        self.used_bits += 8 * qweight.nbytes
        del self.planned_bits[name]


def plan(weights: Dict[str, torch.Tensor], bits: float, prob_bits: int = rans.DEFAULT_PROB_BITS,
         chunk_k: Optional[int] = None, rate_aware: bool = RATE_AWARE, row_power: float = ROW_POWER,
         weighting: str = WEIGHTING) -> _Plan:
    bits = check_bits(bits)
    prob_bits = rans.check_prob_bits(prob_bits)
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if not isinstance(rate_aware, bool):
        raise TypeError(f"rate_aware must be a bool, got {rate_aware!r}")
    if isinstance(row_power, bool) or not isinstance(row_power, (int, float)) or not 0 <= row_power <= 4:
        raise ValueError(f"row_power must be a number in [0, 4], got {row_power!r}")
    layers = {name: _layer(name, w, chunk_k, weighting) for name, w in weights.items()}
    budget = bits * sum(layer.num_weights for layer in layers.values())
    lam = allocate(list(layers.values()), budget, prob_bits, rate_aware, row_power)
    planned = {name: _sizes_at([layer], lam, prob_bits, rate_aware, row_power) for name, layer in layers.items()}
    return _Plan(lam, layers, planned, budget, prob_bits, rate_aware, row_power)


def least_squares_steps(w: torch.Tensor, q: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """fp16 step of each row minimising ||w_n - q_n step_n|| for its codes (the grid's cells
    have their centroids inside, nearer 0); `steps` where a row has no code but 0."""
    qf = q.float()
    fit = (w * qf).sum(1) / (qf * qf).sum(1).clamp_min(1)
    return torch.where((qf != 0).any(1), fit, steps.float()).clamp(2.0 ** -14, 65504.0).half()


def fit_layer(p: _Plan, name: str, quantize, refit_steps: bool = False) -> RansQuantizedWeight:
    """quantize(step, lam, bits_table) -> int16 q [N, K], at the plan's step, then at coarser
    steps until the coded layer fits its share of the budget; records it in the plan.
    refit_steps (round to nearest): REFIT_STEPS times the rows' steps refitted by least
    squares to their codes and the weights rounded again on them."""
    layer = p.layers[name]
    target = p.target_bits(name)
    lam = p.lam / layer.importance

    def fit(refits):
        step = layer.choice[p.lam]
        for attempt in range(40):
            steps = row_steps(layer.weight, step, p.row_power)
            table = quantize_grid(layer.weight, step, lam, p.prob_bits, p.rate_aware, p.row_power).bits_table
            q = quantize(steps, lam, table if p.rate_aware else None)
            for _ in range(refits):
                steps = least_squares_steps(layer.weight, q, steps)
                q = quantize(steps, lam, table if p.rate_aware else None)
            deq = q.float() * steps.float().unsqueeze(1)
            distortion = float((layer.weight - deq).pow(2).sum()) / max(layer.norm2, _TINY)
            coded = encode_grid(GridResult(q, steps, distortion, 0.0, table), layer.chunk_k, p.prob_bits)
            bits = 8 * coded.nbytes
            if bits <= target:
                coded.relative_error = math.sqrt(distortion)
                return coded
            # One bit per weight less per doubling of the step (high-rate slope); then 5% more.
            step *= 2.0 ** ((bits - target) / layer.num_weights) * 1.05 ** (attempt >= 3)
        raise RuntimeError(f"{name}: could not fit the grid into {target / layer.num_weights:.3f} bits per weight")

    coded = fit(0)
    if refit_steps:
        # Refitted steps are finer, so the search above lands on a coarser base step; on a
        # tight budget that can cost more than the refit gains: keep the closer of the two.
        refitted = fit(REFIT_STEPS)
        coded = refitted if refitted.relative_error <= coded.relative_error else coded
    p.done(name, coded)
    return coded


def _rtn(p: _Plan, name: str):
    w = p.layers[name].weight

    def quantize(steps, lam, table):
        s = steps.float().unsqueeze(1)
        return round_rate_aware(w / s, s ** 2 / max(p.layers[name].norm2, _TINY), lam, table)
    return quantize


def grid_weight(weight: torch.Tensor, bits: float, method: str = "rtn", hessian: Optional[torch.Tensor] = None,
                act_order: bool = False, damp: float = 0.01, block_size: int = 128,
                prob_bits: int = rans.DEFAULT_PROB_BITS, chunk_k: Optional[int] = None) -> RansQuantizedWeight:
    """One float weight [N, K] on the grid at `bits` per weight (every byte of the coded
    weight counted), round to nearest or GPTQ (`hessian`): MarlinLinear.from_linear(bits=...)."""
    if method not in ("rtn", "mse", "gptq"):
        raise ValueError(f"method must be 'rtn' (round to nearest) or 'gptq' with bits=, got {method!r}")
    if (method == "gptq") != (hessian is not None):
        raise ValueError("method='gptq' and hessian=H (mean(x x^T) of the layer's inputs) go together")
    p = plan({"layer": weight}, bits, prob_bits, chunk_k)
    if hessian is None:
        return fit_layer(p, "layer", _rtn(p, "layer"), refit_steps=True)
    return fit_layer(p, "layer", lambda steps, lam, table: gptq_grid(
        weight, hessian, steps, lam, table, act_order, damp, block_size))
