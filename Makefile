# Two entry points, each sets up .venv on first use: `make run` (tiny recipe end to end) and `make test`.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

# pip compiles bytecode one file at a time; compileall uses every core (half the install's time on 2 cores).
# The one file excluded is torch's Python 3.12 syntax test, which pip skips as well.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q --no-compile torch==2.13.0
	$(VENV)/bin/pip install -q --no-compile -e '.[dev]'
	$(VENV)/bin/python -m compileall -q -j 0 -x py312_intrinsics $(VENV)/lib
	touch $(STAMP)

.PHONY: run test lint typecheck docs
run: $(STAMP)
	$(VENV)/bin/osdp-platform submit recipes/tiny.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# the README's recipe reference, rendered from platform/osdp_platform/recipe/schema.py
docs: $(STAMP)
	$(VENV)/bin/python -m osdp_platform.recipe.docs --write README.md

test: $(STAMP)
	@$(MAKE) --no-print-directory lint typecheck
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --durations=15
