# Each target sets itself up: a fresh clone needs only Python 3.11+ and network access to PyPI.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# 8 simulated CPU devices: the suite runs on them on every host (tests/conftest.py).
export JAXDIST_CPU_DEVICES ?= 8

.PHONY: install install-gpu train test test-fast test-gpu slurm
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# On an NVIDIA GPU host: the package with JAX's CUDA plugin (CUDA=cuda13 where the driver runs CUDA 13).
CUDA ?= cuda12
install-gpu: $(VENV)/.installed-$(CUDA)

$(VENV)/.installed-$(CUDA): $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test,$(CUDA)]'
	touch $@

train: install
	$(BIN)/jaxdist train configs/tiny.yaml $(ARGS)

# A one-node Slurm on this machine for tests/test_slurm.py: installed (Debian/Ubuntu, as root) and
# started where missing, else a second's check.
slurm:
	bash .ci/local_cluster.sh

test: install slurm
	$(BIN)/pytest -n 2 --dist worksteal --durations=15 $(ARGS)

test-fast: install
	$(BIN)/pytest -n 2 --dist worksteal -m "not slow" $(ARGS)

# On a GPU host: the tests marked `gpu` (the kernels, FP8 GEMMs, transformers loading the exports) on
# the GPU, and only those; `make test` runs the CPU-simulated suite there as everywhere.
test-gpu: install-gpu
	JAXDIST_GPU_TESTS=1 $(BIN)/pytest -m gpu $(ARGS)
