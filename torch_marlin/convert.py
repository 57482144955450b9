"""`python -m torch_marlin.convert SRC DST ...`: the same as `torch-marlin convert SRC DST ...`.

The converter lives in torch_marlin.hf.converter; `convert` and
`ConversionSummary` are re-exported here, where the docs have always named them.
"""

from .hf.converter import ConversionSummary, convert

__all__ = ["ConversionSummary", "convert"]

if __name__ == "__main__":
    import sys

    from .cli import main

    sys.exit(main(["convert", *sys.argv[1:]]))
