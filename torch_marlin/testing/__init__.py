"""Testing helpers: the MSL CPU emulator (mslsim) and the Metal dispatch runner."""
from .metal import run_metal  # noqa: F401
