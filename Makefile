# shardlm: `make demo` and `make test` each set up .venv on first use.
#
#   TORCH=...            torch requirement installed first (default: the release we test on).
#   USE_SYSTEM_TORCH=1   build .venv with --system-site-packages and keep the torch you have
#                        (e.g. your cluster's CUDA build); nothing is installed over it.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
NPROC ?= 2
# pytest workers for `make test` (pytest-xdist; each test module runs whole on one worker, so a module's one
# spawn of ranks is shared by its tests as before). The suite waits on launches, timeouts and collectives for a
# third of its time: 2 workers on 2 cores took 11m33s against 17m06s in one process. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST_WORKERS := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: install demo test test-fast bench clean

$(VENV)/.base:
	@if [ -n "$(USE_SYSTEM_TORCH)" ] && ! $(PYTHON) -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)"; then \
	  echo "USE_SYSTEM_TORCH=1 but $(PYTHON) ($$(command -v $(firstword $(PYTHON)))) has no torch; install torch into it first, or drop USE_SYSTEM_TORCH" >&2; exit 1; fi
	$(PYTHON) -m venv $(if $(USE_SYSTEM_TORCH),--system-site-packages) $(VENV)
	@if [ -n "$(USE_SYSTEM_TORCH)" ]; then \
	  $(PY) -c "import torch; print('using torch', torch.__version__)" 2>$(VENV)/.torch-error || { \
	  echo "USE_SYSTEM_TORCH=1 but torch does not import in $(VENV) ($$(tail -n 1 $(VENV)/.torch-error)); if $(PYTHON) is itself a venv, use the python it was made from" >&2; exit 1; }; \
	elif ! $(PY) -c "import torch" 2>/dev/null; then $(PIP) install "$(TORCH)"; fi
	@touch $@

$(VENV)/.core: $(VENV)/.base pyproject.toml
	$(PIP) install -e .
	@touch $@

$(VENV)/.dev: $(VENV)/.base pyproject.toml
	$(PIP) install -e '.[dev,hf,viz,fp8,data,wandb,eval,docs]'
	@touch $@ $(VENV)/.core

install: $(VENV)/.core

# the demo ends by drawing its curves (runs/demo/plot.png: train.output_dir of configs/demo.toml): needs [viz]
$(VENV)/.viz: $(VENV)/.core
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) install -e '.[viz]'
	@touch $@

demo: $(VENV)/.viz
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m shardlm train --config configs/demo.toml
	$(VENV)/bin/shardlm plot runs/demo

test: $(VENV)/.dev
	$(PY) -m pytest -q $(PYTEST_WORKERS)

test-fast: $(VENV)/.dev
	$(PY) -m pytest -q $(PYTEST_WORKERS) -m "not slow"

bench: $(VENV)/.dev
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs
