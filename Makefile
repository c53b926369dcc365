# Quick start: `make demo` runs the main job, `make test` runs the whole suite, `make test-fast`
# the planner's torch-free tiers (under a minute on 2 idle cores, on two pytest-xdist workers). All
# create .venv (Python 3.12, pinned requirements) on a fresh machine first.
PYTHON312 ?= $(shell PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test lint test-fast test-slow test-random test-shuffled test-gpu clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt setup.py
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (pyenv 3.12.1 or python3.12 on PATH)"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	@# Editable installs do not ship the .pth that enables --auto-parallel; copy it (a wheel install does).
	cp megatron_pipette_autoload.pth "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	touch $@

# The main job: Megatron's training loop with --auto-parallel, 4 processes on CPU (probe, plan,
# re-ranked groups, falling loss), after the offline planner on its built-in default.
demo: venv
	$(VENV)/bin/pipette plan --top 5
	PYTHON=$(PY) bash examples/auto_parallel_cpu.sh

# Tiers (markers in pytest.ini): test-fast is the planner (spec, cost, plan, cli, golden outputs,
# the probe's pure parts, reports) with importing torch made an error (tests marked megatron are
# left to make test), on two workers (pytest-xdist; one worker needs about 100 s of CPU for it);
# test-random is the same with hypothesis drawing new examples; test-shuffled runs `make test`'s
# tests in a random order (modules shuffled, and tests within each), printing the seed first:
# `make test-shuffled SEED=n` repeats an order; test-gpu runs the tests that need CUDA (they skip
# without it).
FAST := -m "not torchrun and not slow and not gpu and not megatron" tests/spec tests/cost tests/plan tests/cli \
        tests/golden tests/probe tests/twin tests/architecture tests/calibration tests/report

# `make test` is the suite CI runs (about 7 minutes of tests on 2 cores); the tests marked slow (a
# resume on a smaller allocation, a hung rank, a lost elastic node, the matrix of checkpoint
# transitions: about 10 minutes) run with `make test-slow`.
test: venv lint
	$(PY) -m pytest -q -m "not slow"

test-slow: venv
	$(PY) -m pytest -q -m slow

# Style and correctness checks (pyproject.toml's ruff settings), part of `make test`.
lint: venv
	$(VENV)/bin/ruff check .

test-fast: venv
	PIPETTE_TEST_NO_TORCH=1 $(PY) -m pytest -q -n 2 $(FAST)

test-random: venv
	PIPETTE_TEST_NO_TORCH=1 HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q -n 2 $(FAST)

ifndef SEED
SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
test-shuffled: venv
	@echo "test order: --random-order-seed=$(SEED) (make test-shuffled SEED=$(SEED) repeats it)"
	$(PY) -m pytest -q -m "not slow" --random-order-seed=$(SEED)

test-gpu: venv
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info
