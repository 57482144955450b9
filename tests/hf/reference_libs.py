"""The source libraries the MLX, GGUF and bitsandbytes import tests compare against."""

from __future__ import annotations

import importlib
import os

import pytest


def require(module: str, install: str):
    """Import a reference library. The test extra installs it, so CI must run these tests
    (a missing one is an error there); elsewhere the tests skip, saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get("CI"):
            raise RuntimeError(f"CI requires {module} ({install}; pyproject's test extra)") from None
        pytest.skip(f"needs {module}, the reference for this import ({install})", allow_module_level=True)
