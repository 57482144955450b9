"""benchmarks/bench_rans_model.py: layer_ratios times every entropy-coded layer of a model
against the same layer of a dense copy, one row per layer and M (a tiny model here; the
benchmark runs it on all-MiniLM-L6-v2)."""
import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_rans_model  # noqa: E402

import torch_marlin  # noqa: E402
from torch_marlin.layouts import rans as rans_layout  # noqa: E402

pytestmark = pytest.mark.skipif(not rans_layout.has_ops(), reason="needs the C++ ops")


def _models():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 128))
    coded, dense = copy.deepcopy(net), copy.deepcopy(net)
    torch_marlin.quantize_model(coded, "tcq", -1, bits=3.6)
    torch_marlin.quantize_model(dense, "fp4", 64)
    return coded, dense


def test_one_row_per_coded_layer_and_m():
    coded, dense = _models()
    names = [name for name, _ in bench_rans_model.coded_layers(coded)]
    assert names == ["0", "2"]
    rows = bench_rans_model.layer_ratios(coded, dense, [1, 3], rounds=1)
    assert [(r["layer"], r["m"]) for r in rows] == [("0", 1), ("0", 3), ("2", 1), ("2", 3)]
    for r in rows:
        assert (r["k"], r["n"]) == ((128, 64) if r["layer"] == "0" else (64, 128))
        assert 1 <= r["symbols"] <= 256
        assert r["rans_s"] > 0 and r["dense_s"] > 0 and math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert r["own_ratio"] is None and r["own_rounds"] == 0  # no probe: no round is labelled
