"""English calibration text written for this project: short everyday, news, science and
technical sentences, one per line (torch_marlin/testing/calibration_en.txt). It shares no
sentence with minilm.SENTENCES, the held-out set the quality figures are measured on."""

from __future__ import annotations

import os
from typing import List

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration_en.txt")


def sentences(limit: int = None) -> List[str]:
    """The calibration sentences in file order (the first `limit` of them)."""
    with open(PATH, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines if limit is None else lines[:limit]
