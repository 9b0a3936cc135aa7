# Two commands set everything up from a fresh clone: `make demo` and `make test`.
# Both create .venv in the checkout, install torch==2.13.0 (a CPU wheel) and this package into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-install
# pytest options, e.g. `make test PYTEST_ARGS="-k moe -x"`
PYTEST_ARGS ?=

.PHONY: demo test lint install clean gpu-check docker

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first and pinned, so the package's range (torch>=2.11,<2.14) is already satisfied and
# nothing pulls a CUDA build. --no-build-isolation keeps the build from asking for torch again.
$(STAMP): pyproject.toml CMakeLists.txt | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "scikit-build-core>=0.10" ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dynn demo

# The runtime's tests run twice: on the default (native) event source, then on the Python one.
test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)
	DYNN_EVENTS=python $(PY) -m pytest -q -p no:cacheprovider tests/runtime $(PYTEST_ARGS)

# On a GPU machine with torch already installed (no .venv there): installs this package into that
# Python and runs tools/gpu_check.py (tests, bench --real, racecheck), appending to docs/benchmarks.md.
# Without CUDA it still runs: the gpu tests skip and the GPU sections say so.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(GPU_PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

# The artifact-evaluation image (PyTorch v2.13.0 + patches/, then this package): where Docker exists.
# make docker MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 IMAGE=dynn-ae   (docs/artifact-evaluation.md)
docker:
	build_tools/docker_build.sh

lint: $(STAMP)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check dynn_runtime models tests build_tools

clean:
	rm -rf $(VENV) build dist .pytest_cache
