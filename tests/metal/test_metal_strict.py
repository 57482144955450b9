"""Every Metal source of the project passes the emulator's strict check (what Apple's compiler rejects:
address spaces, recursion, double, the C++ standard library, ...; docs/MSLSIM.md). The kernel tests
compile with it too; this names the sources one by one."""
import os
from pathlib import Path

import pytest

import mslsim
from torch_marlin.testing.metal import metal_dir
from mslsim import _strict

HERE = Path(__file__).resolve().parent
SOURCES = sorted(metal_dir().glob("*.metal")) + sorted((HERE / "kernels").glob("*.metal"))
# CI (.ci/run installs clang-19) must run the whole check; elsewhere the clang part is optional.
STRICT = True if (_strict.find_clang()[0] or os.environ.get("CI")) else None


@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_strict_check(source):
    mslsim.compile(str(source), include_dirs=(str(metal_dir()),), strict=STRICT)
