import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

try:
    import mslsim  # noqa: F401
    import torch_marlin  # noqa: F401
except ImportError:  # running from a source checkout without installing (make test installs both packages)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def pytest_collection_finish(session):
    """A test module with a long build of its own (a `start_background_build()`:
    tests/test_cpu_kernels_aarch64.py's cross-compile) starts it as soon as the
    session has collected its tests, so that it runs beside the tests before it."""
    starts = {getattr(item.module, "start_background_build", None) for item in session.items
              if getattr(item, "module", None) is not None}
    for start in starts - {None}:
        start()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class Terminal:
    """Writes to pytest's terminal from inside a test, past output capture: for
    the steps that take a minute or more (a cross-compile, a child test run), so
    that `pytest -q` does not sit silent on one test."""

    def __init__(self, config):
        self._capture = config.pluginmanager.getplugin("capturemanager")
        self._reporter = config.pluginmanager.getplugin("terminalreporter")

    def write(self, text):
        if self._reporter is None:
            return
        with self._capture.global_and_fixture_disabled() if self._capture else contextlib.nullcontext():
            self._reporter.write(text, flush=True)

    @contextlib.contextmanager
    def step(self, what):
        """Says what is running and, once done, how long it took."""
        start = time.monotonic()
        self.write(f"\n{what} ...")
        yield
        self.write(f" {time.monotonic() - start:.0f} s\n")


@pytest.fixture(scope="session")
def terminal(pytestconfig):
    return Terminal(pytestconfig)


_PROGRESS = set(".sxXFE")  # the letters of `pytest -q` progress lines


@pytest.fixture(scope="session")
def child_pytest(terminal):
    """run(label, args, env, timeout) -> (returncode, output): `pytest -q args` in a
    child process with `env` (how the tests run another CPU kernel build: a process
    chooses one), its progress letters shown after `label` as they come."""

    def run(label, args, env, timeout):
        cmd = [sys.executable, "-u", "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timed_out = threading.Event()
        killer = threading.Timer(timeout, lambda: (timed_out.set(), proc.kill()))
        killer.start()
        output, line, shown = [], "", 0
        terminal.write(f"\n{label}:\n")
        try:
            for ch in iter(lambda: proc.stdout.read(1), ""):
                output.append(ch)
                line = "" if ch == "\n" else line + ch
                if ch in _PROGRESS and set(line) <= _PROGRESS:
                    shown += 1
                    terminal.write(ch if shown % 72 else ch + "\n")
            proc.wait()
        finally:
            killer.cancel()
        text = "".join(output)
        summary = text.rstrip().rsplit("\n", 1)[-1] if text.strip() else "no output"
        terminal.write(f" {summary}\n")
        assert not timed_out.is_set(), f"{label}: no result after {timeout} s:\n{text[-4000:]}"
        return proc.returncode, text

    return run


@pytest.fixture(scope="session")
def rerun_under_build(child_pytest):
    """run(build, label, args): `pytest -q args` again in a child process forced onto one
    CPU kernel build (TORCH_MARLIN_CPU_KERNELS); skips a build this CPU cannot run and
    the one this process runs (the tests themselves ran it)."""
    import json

    def run(build, label, args):
        info = json.loads(torch.ops.marlin._cpu_kernels())
        if info["builds"][build]:
            pytest.skip(f"{build}: {info['builds'][build]}")
        if build == info["selected"]:
            pytest.skip(f"{build}: the build this run uses (the tests above ran it)")
        env = dict(os.environ, TORCH_MARLIN_CPU_KERNELS=build)
        returncode, output = child_pytest(f"{label} under the {build} build", args, env, timeout=900)
        assert returncode == 0, output[-6000:]
        assert " passed" in output and " failed" not in output

    return run
