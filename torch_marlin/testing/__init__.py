"""Testing helpers: the Metal dispatch runner on the MSL CPU emulator (run_metal; the emulator is the
separate package mslsim, mslsim/ in the repository), the MiniLM and calibration helpers."""
from .metal import run_metal  # noqa: F401
