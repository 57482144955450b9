import os
import sys

try:
    import torch_marlin.testing.mslsim  # noqa: F401
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
