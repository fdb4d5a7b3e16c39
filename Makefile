# Two commands: `make run` (the default demo through `flwr run .`) and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
export DPFL_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: run test install bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

# The default demo: DPSGD-GC on scikit-learn's digits, 10 virtual SuperNodes, Ray simulation.
run: install
	$(PY) -m dpfl flower

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) results .flwr-home
