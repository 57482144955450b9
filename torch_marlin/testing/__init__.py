"""Testing helpers: the MSL CPU emulator (mslsim) and the Metal dispatch runner."""
