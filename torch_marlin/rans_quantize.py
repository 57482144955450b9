"""Quantizers of the entropy-coded layout (docs/ENTROPY.md).

- Lossless (`entropy_code=True`): the codes of a dense 4-bit weight, entropy-coded
  (RansQuantizedWeight.from_dense); decoding gives the identical codes.
- Rate-controlled grid (`bits=<float>`): every weight on a uniform grid q * step[n]
  (q in -127..127, one fp16 step per output row), coded with one frequency table per
  layer. `bits` is the average over the quantized layers with every byte of their
  weights counted (words, offsets, states, table, steps).
- Trellis-coded grid ("tcq", the default of round to nearest with `bits=`): the same
  codes read through the 4-state trellis of docs/FORMAT.md (levels j * step[n]); the
  codes are chosen by a Viterbi search per row and chunk (`trellis_search`), which
  minimises the squared error (plus TCQ_LAMBDA x the codes' coded bits, off by default).

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
from .layouts.rans import GRID, TCQ, RansQuantizedWeight

MAX_Q = 127  # |q| bound of the quantizers (symbols 1..255)
STEP_MULTIPLIERS = (0.85, 1.0, 1.15)  # around the high-rate step of a lambda
RDO_PASSES = 2
REFIT_STEPS = 3  # round-to-nearest rounds again after refitting the steps: docs/ENTROPY.md
ROW_POWER = 1.0  # step of row n ~ rms(row)^ROW_POWER: measured in docs/ENTROPY.md
RATE_AWARE = False  # rate-aware rounding by default: measured in docs/ENTROPY.md
# Rate-aware trellis search: TCQ_LAMBDA step^2 per coded bit, TCQ_PASSES searches with the
# table of the previous pass. Off by default: it lowers the weight error at a given size but
# not the embedding error (measured in docs/ENTROPY.md), as rate-aware rounding on the grid.
TCQ_LAMBDA = 0.0
TCQ_PASSES = 2
TCQ_STEP_RATIO = 0.5  # tcq step / the allocation's grid step (levels j are twice as dense)
FILL_TOLERANCE = 0.003  # tcq: a layer at most this fraction below its share of the budget is done
FILL_ATTEMPTS = 3  # ... or after this many attempts from the first that fitted (the closest that fitted)
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


def row_steps(w: torch.Tensor, step: float, row_power: float = ROW_POWER, max_level: int = MAX_Q) -> torch.Tensor:
    """fp16 steps [N] of one layer: `step` times (rms of the row / rms of the layer)^row_power,
    never finer than the row's absmax / max_level (no weight clamped)."""
    rms_row = w.pow(2).mean(1).sqrt()
    rms = float(w.pow(2).mean().sqrt())
    shape = (rms_row / max(rms, _TINY)).clamp_min(1e-3).pow(row_power) if row_power else torch.ones_like(rms_row)
    # Never finer than the row's absmax / max_level: no weight is clamped (and sizes fall with lambda).
    finest = w.abs().amax(1) / max_level * (1 + 2.0 ** -10)
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


# --- trellis-coded grid ("tcq") -----------------------------------------------------------

# |y| = |w| / step bound: the candidates floor(y / 2) - 1 .. + 2 of the search stay within |k| <= 127.
TCQ_MAX_LEVEL = 2 * MAX_Q - 4


_BRANCH_BLOCK = 1 << 17  # lanes x steps of branch costs computed at once (cache-sized: measured)


def _branch_costs(y: torch.Tensor, rate: Optional[torch.Tensor]):
    """For y [S, L] (|y| <= TCQ_MAX_LEVEL): the cost and code of the best k per quantizer q
    (0: level 2k, 1: 2k - sign(k)) and parity of k, both [S, L, q, parity], the cost being
    (y - level)^2 + rate[k + 128]. Candidates k = floor(y / 2) - 1 + i, i = 0..3: the two
    nearest levels of each parity in either quantizer."""
    base = torch.floor(y * 0.5) - 1
    k = base.unsqueeze(-1) + torch.arange(4, dtype=torch.float32)  # [S, L, i]
    yy = y.unsqueeze(-1)
    d = torch.stack(((yy - 2 * k).square_(), (yy - 2 * k + torch.sign(k)).square_()), -2)  # [S, L, q, i]
    if rate is not None:
        d += rate[(k + rans.GRID_OFFSET).long()].unsqueeze(-2)
    # i = 2a + c: candidates c and 2 + c have the same parity, (base + c) & 1.
    farther = d[..., 2:] < d[..., :2]
    best = torch.minimum(d[..., :2], d[..., 2:])
    codes = base[..., None, None] + 2 * farther + torch.arange(2)
    odd_base = (base.long() & 1).bool()[..., None, None]  # class 0 holds the odd k
    return (torch.where(odd_base, best.flip(-1), best),
            torch.where(odd_base, codes.flip(-1), codes).to(torch.int16))


def _viterbi(y: torch.Tensor, rate: Optional[torch.Tensor]) -> torch.Tensor:
    """Codes k [L, T] (int16) of lanes y [L, T] (each lane one trellis run from state 0)
    minimising sum_t (y_t - j_t)^2 + rate[k_t + 128] (rate: None or [256]).

    States 0, 1 read k as level 2k, states 2, 3 as 2k - sign(k); the next state is
    (state >> 1) | ((state ^ k) & 1) << 1. The best k per quantizer (state >> 1) and parity
    does not depend on the path (_branch_costs, computed for many steps at once); new state
    2h + q comes from the states 2q + low with a k of parity low ^ h: one min over `low`."""
    lanes, steps = y.shape
    yt = y.t().contiguous()
    cost = torch.full((lanes, 2, 2), float("inf"))  # [L, q, low] = state 2q + low
    cost[:, 0, 0] = 0
    choice = torch.empty(steps, lanes, 2, 2, dtype=torch.bool)  # [t, L, h, q]: the `low` of new state 2h + q
    picks = torch.empty(steps, lanes, 2, 2, dtype=torch.int16)  # best k per (quantizer, parity)
    block = max(1, _BRANCH_BLOCK // lanes)
    for t0 in range(0, steps, block):
        by_parity, picks[t0:t0 + block] = _branch_costs(yt[t0:t0 + block], rate)
        swapped = by_parity.flip(-1)  # [.., q, low] -> the branch of parity low ^ 1
        for t in range(by_parity.shape[0]):
            stay, move = cost + by_parity[t], cost + swapped[t]  # h = 0, 1: parity low ^ h
            choice[t0 + t, :, 0] = stay[..., 1] < stay[..., 0]
            choice[t0 + t, :, 1] = move[..., 1] < move[..., 0]
            cost = torch.stack((torch.minimum(stay[..., 0], stay[..., 1]),
                                torch.minimum(move[..., 0], move[..., 1])), 1)  # [L, h, q] = [L, q', low']
    codes = torch.empty(steps, lanes, dtype=torch.int16)
    state = cost.view(lanes, 4).argmin(1)
    rows = torch.arange(lanes)
    choice = choice.view(steps, lanes, 4)
    for t in range(steps - 1, -1, -1):
        low = choice[t, rows, state].long()
        q, h = state & 1, state >> 1
        codes[t] = picks[t, rows, q, low ^ h]
        state = 2 * q + low
    return codes.t()


def trellis_search(y: torch.Tensor, chunk_k: int, lam: float = 0.0,
                   bits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes k [N, K] (int16, |k| <= 127) of y = w / step [N, K] on the "tcq" trellis: per row
    and chunk of chunk_k columns (each starting in state 0) the path minimising
    sum (y - j)^2 + lam * bits[k + 128] (bits: coded bits per symbol; plain distortion without)."""
    chunk_k = rans.check_chunk_k(chunk_k)
    # Steps finer than row_steps' (absmax / TCQ_MAX_LEVEL) clamp the weights beyond reach.
    y = y.detach().to(device="cpu", dtype=torch.float32).clamp(-TCQ_MAX_LEVEL, TCQ_MAX_LEVEL)
    n, k = y.shape
    rate = None if bits is None else lam * bits.float().cpu()
    full = k // chunk_k * chunk_k
    codes = torch.empty(n, k, dtype=torch.int16)
    if full:  # whole chunks: one lane per (row, chunk)
        lanes = y[:, :full].reshape(n * (full // chunk_k), chunk_k)
        codes[:, :full] = _viterbi(lanes, rate).reshape(n, full)
    if full < k:
        codes[:, full:] = _viterbi(y[:, full:].contiguous(), rate)
    return codes


def tcq_weight_levels(codes: torch.Tensor, chunk_k: int) -> torch.Tensor:
    """Levels j [N, K] (float32) the decoder gives codes k [N, K] (rans.tcq_levels)."""
    symbols = (codes.t().long() + rans.GRID_OFFSET).to(torch.uint8)
    return rans.tcq_levels(symbols, chunk_k).t().float()


def quantize_tcq(y: torch.Tensor, chunk_k: int, prob_bits: int = rans.DEFAULT_PROB_BITS,
                 bits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes [N, K] of y = w / step: TCQ_PASSES trellis searches at TCQ_LAMBDA x the coded bits
    per symbol under the table of the previous pass; the first pass under `bits` (a table of
    a previous, similar search), or without a table and one pass more."""
    passes = TCQ_PASSES if TCQ_LAMBDA > 0 else 0
    if bits is None or not passes:
        codes = trellis_search(y, chunk_k)
    else:
        codes = trellis_search(y, chunk_k, TCQ_LAMBDA, bits)
        passes -= 1
    for _ in range(passes):
        codes = trellis_search(y, chunk_k, TCQ_LAMBDA, symbol_bits(symbol_counts(codes).float(), prob_bits))
    return codes


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
    # chunk_k is the longest chunk: the kernels take at most K rounded up to 32.
    chunk = default_grid_chunk_k(k) if chunk_k is None else min(rans.check_chunk_k(chunk_k),
                                                                -(-k // rans.LANES) * rans.LANES)
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


def encode_grid(result: GridResult, chunk_k: int, prob_bits: int, weight_format: str = GRID
                ) -> RansQuantizedWeight:
    symbols = (result.codes.t() + rans.GRID_OFFSET).to(torch.uint8)
    return RansQuantizedWeight.from_codes(symbols, result.steps.unsqueeze(0).contiguous(), None, weight_format, -1,
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


def _coded(layer: _Layer, codes: torch.Tensor, levels: torch.Tensor, steps: torch.Tensor, table, prob_bits: int,
           weight_format: str) -> RansQuantizedWeight:
    """The coded layer of codes [N, K] (levels: what they decode to) on steps [N], with its
    relative_error."""
    deq = levels * steps.float().unsqueeze(1)
    distortion = float((layer.weight - deq).pow(2).sum()) / max(layer.norm2, _TINY)
    coded = encode_grid(GridResult(codes, steps, distortion, 0.0, table), layer.chunk_k, prob_bits, weight_format)
    coded.relative_error = math.sqrt(distortion)
    return coded


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
            coded = _coded(layer, q, q.float(), steps, table, p.prob_bits, GRID)
            bits = 8 * coded.nbytes
            if bits <= target:
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


def fit_tcq_layer(p: _Plan, name: str) -> RansQuantizedWeight:
    """The trellis search of one planned layer, at the step that fills its share of the
    budget (FILL_TOLERANCE; a secant search in log step from the plan's grid step x
    TCQ_STEP_RATIO: the plan's sizes are the scalar grid's). Each attempt searches on the
    row steps of its base step, starting from the previous attempt's code table, then refits
    the steps to the codes' levels by least squares; records the layer in the plan."""
    layer = p.layers[name]
    target = p.target_bits(name)
    log_step = math.log2(max(layer.choice[p.lam] * TCQ_STEP_RATIO, 2.0 ** -24))  # an all-zero weight's is 0
    table, fitted, tried, fills = None, None, [], 0
    for attempt in range(40):
        steps = row_steps(layer.weight, 2.0 ** log_step, p.row_power, TCQ_MAX_LEVEL)
        codes = quantize_tcq(layer.weight / steps.float().unsqueeze(1), layer.chunk_k, p.prob_bits, table)
        levels = tcq_weight_levels(codes, layer.chunk_k)
        # Searching again on the refitted (finer) steps would raise the rate: the budget is met
        # at the search's steps and the refit only lowers the error of the codes found.
        steps = least_squares_steps(layer.weight, levels, steps)
        table = symbol_bits(symbol_counts(codes).float(), p.prob_bits)
        coded = _coded(layer, codes, levels, steps, table, p.prob_bits, TCQ)
        bits = 8 * coded.nbytes
        tried.append((log_step, bits))
        if bits <= target and (fitted is None or coded.relative_error < fitted.relative_error):
            fitted = coded
        if fitted is not None:
            fills += 1
            if target - 8 * fitted.nbytes <= FILL_TOLERANCE * target or fills > FILL_ATTEMPTS:
                p.done(name, fitted)
                return fitted
        # Secant in log2(step) (start: the high-rate slope, one bit per weight per doubling),
        # aiming inside the tolerance, 5% coarser per attempt after the third miss; once steps
        # that fit and steps that do not are known, inside that bracket (else its midpoint).
        slope = -layer.num_weights
        if len(tried) > 1 and tried[-1][0] != tried[-2][0]:
            measured = (tried[-1][1] - tried[-2][1]) / (tried[-1][0] - tried[-2][0])
            slope = min(max(measured, -2.0 * layer.num_weights), -0.5 * layer.num_weights)
        log_step += (target * (1 - FILL_TOLERANCE / 2) - bits) / slope
        log_step += math.log2(1.05) * (attempt >= 3 and bits > target)
        too_fine = [x for x, b in tried if b > target]
        fitting = [x for x, b in tried if b <= target]
        if too_fine and fitting and not max(too_fine) < log_step < min(fitting):
            log_step = (max(too_fine) + min(fitting)) / 2
    raise RuntimeError(f"{name}: could not fit the trellis-coded grid into {target / layer.num_weights:.3f} "
                       f"bits per weight")


def _rtn(p: _Plan, name: str):
    w = p.layers[name].weight

    def quantize(steps, lam, table):
        s = steps.float().unsqueeze(1)
        return round_rate_aware(w / s, s ** 2 / max(p.layers[name].norm2, _TINY), lam, table)
    return quantize


def round_to_nearest(p: _Plan, name: str, weight_format: str) -> RansQuantizedWeight:
    """Round to nearest (the grid) or the trellis search (tcq) of one planned layer."""
    if weight_format == TCQ:
        return fit_tcq_layer(p, name)
    return fit_layer(p, name, _rtn(p, name), refit_steps=True)


def value_kind(weight_format: str, group_size: int, method: str) -> str:
    """The value kind of bits= for quantize_model / from_linear's weight_format and group_size:
    "grid" or "tcq" as named, else (the defaults "fp4", 128) tcq for round to nearest and the
    grid for GPTQ, whose column-by-column error feedback has no trellis search."""
    if (weight_format, group_size) == ("fp4", 128):
        return GRID if method == "gptq" else TCQ
    if weight_format not in (GRID, TCQ) or group_size != -1:
        raise ValueError(f"bits= selects the grid (weight_format='grid' or 'tcq', group_size=-1); got "
                         f"weight_format={weight_format!r}, group_size={group_size} (for lossless coding of a "
                         f"4-bit format use entropy_code=True)")
    if weight_format == TCQ and method == "gptq":
        raise ValueError("weight_format='tcq' is made by round to nearest (method='rtn'); GPTQ with bits= "
                         "quantizes onto the scalar grid (weight_format='grid')")
    return weight_format


def grid_weight(weight: torch.Tensor, bits: float, kind: str, method: str = "rtn",
                hessian: Optional[torch.Tensor] = None, act_order: bool = False, damp: float = 0.01,
                block_size: int = 128, prob_bits: int = rans.DEFAULT_PROB_BITS,
                chunk_k: Optional[int] = None) -> RansQuantizedWeight:
    """One float weight [N, K] on the grid at `bits` per weight (every byte of the coded
    weight counted), round to nearest or GPTQ (`hessian`): MarlinLinear.from_linear(bits=...).
    kind: "grid" or "tcq", as value_kind chose it for the method."""
    if method not in ("rtn", "mse", "gptq"):
        raise ValueError(f"method must be 'rtn' (round to nearest) or 'gptq' with bits=, got {method!r}")
    if (method == "gptq") != (hessian is not None):
        raise ValueError("method='gptq' and hessian=H (mean(x x^T) of the layer's inputs) go together")
    p = plan({"layer": weight}, bits, prob_bits, chunk_k)
    if hessian is None:
        return round_to_nearest(p, "layer", kind)
    return fit_layer(p, "layer", lambda steps, lam, table: gptq_grid(
        weight, hessian, steps, lam, table, act_order, damp, block_size))
