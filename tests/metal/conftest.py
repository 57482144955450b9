import os

import pytest

from metal_helpers import FLUSH_SUBNORMALS_ENV, LARGEST_ERRORS, emulator_unavailable_reason


@pytest.fixture(scope="module", autouse=True)
def _flush_subnormals():
    """The kernels run as on a GPU that flushes fp16 / fp32 subnormals (docs/MSLSIM.md): a decode that
    depends on them gives wrong results here. One run of the suite covers both kinds of GPU, the kernels
    being subnormal-free (docs/KERNELS.md); TORCH_MARLIN_MSLSIM_FLUSH_SUBNORMALS=0 runs it IEEE.
    Module scope: set before the modules' own library fixtures, and undone before tests/mslsim."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FLUSH_SUBNORMALS_ENV, os.environ.get(FLUSH_SUBNORMALS_ENV, "1"))
        yield


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
