import os

import pytest

from metal_helpers import LARGEST_ERRORS, emulator_unavailable_reason


def pytest_collection_modifyitems(config, items):
    reason = emulator_unavailable_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=f"mslsim emulator unusable: {reason}")
    here = os.path.dirname(__file__)
    for item in items:
        path = str(item.fspath)
        if path.startswith(here) and os.path.basename(path) not in _NO_EMULATOR:
            item.add_marker(marker)


# Test files that do not run kernels on the emulator.
_NO_EMULATOR = {"test_metal_mps.py", "test_metal_mm_syntax.py", "test_embed_metal.py"}


def pytest_terminal_summary(terminalreporter):
    if not LARGEST_ERRORS:
        return
    terminalreporter.write_sep("-", "largest max|metal - cpu| / max|cpu| (tests/metal)")
    for (family, dtype), err in sorted(LARGEST_ERRORS.items()):
        terminalreporter.write_line(f"{family:12} {dtype:9} {err:.2e}")
