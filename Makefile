# Two commands matter (see README): `make demo` and `make test`. Both create or refresh .venv.
PYTHON ?= python3
VENV   := .venv
# CI pins the CPU wheel; on a GPU machine pass your own, e.g. `make test TORCH=torch`.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed-$(shell echo '$(TORCH)' | tr -c 'A-Za-z0-9.\n' _)
# Test processes in parallel (pytest-xdist): most tests wait on servers and agent processes.
TEST_WORKERS ?= 2

.PHONY: demo test test-soak test-gpu lint typecheck docs format bench-stall bench-nvme bench-plan bench-all clean

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "tierpipe needs Python >= 3.11 (set PYTHON=...)")'
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet "$(TORCH)" -e ".[dev]"
	@rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(VENV)/bin/tierpipe demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS)

# 200 checkpoints with random agent kills; reports the agent's memory (deselected by `make test`).
test-soak: $(STAMP)
	$(VENV)/bin/python -m pytest -m soak -s -p no:cacheprovider

# The CUDA paths on a real GPU (skipped without one): `make test-gpu TORCH=torch`.
test-gpu: $(STAMP)
	$(VENV)/bin/python -m pytest tests/gpu -v -s -p no:cacheprovider

lint: $(STAMP) typecheck
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy sees the package as installed (`tierpipe`, `tierpipe.stages`, `tierpipe.schemas`) through
# a tree of links to the repository's folders; the benchmarks, run from the repository root, are
# checked against that same package (so a changed signature fails here, not in a slow bench test).
typecheck: $(STAMP)
	@rm -rf build/typecheck && mkdir -p build/typecheck/tierpipe
	@for e in pipeline/*.py pipeline/*/; do ln -s "$$PWD/$${e%/}" build/typecheck/tierpipe/; done
	@ln -s "$$PWD/stages" "$$PWD/schemas" build/typecheck/tierpipe/
	$(VENV)/bin/mypy -p tierpipe
	$(VENV)/bin/mypy tests/contract_types.py
	$(VENV)/bin/mypy bench

# The API reference, generated from the docstrings (mkdocs.yml, docs/), into build/docs; any
# warning (a broken link, a docstring that does not parse) fails it.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir build/docs

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench-stall: $(STAMP)
	$(VENV)/bin/python -m bench stall --size-gib 2

bench-nvme: $(STAMP)
	$(VENV)/bin/python -m bench nvme --size-gib 2

# Recovery planning and event replay at scale, on synthetic events (no shard data).
bench-plan: $(STAMP)
	$(VENV)/bin/python -m bench plan

# Every bench small enough for a before/after comparison in a few minutes: one JSON line each,
# paired ratios with their 90 % intervals and verdicts (closing notes use it).
bench-all: $(STAMP)
	$(VENV)/bin/python -m bench all --quick

clean:
	rm -rf $(VENV) build tierpipe-data .pytest_cache .ruff_cache .mypy_cache .hypothesis
