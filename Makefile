# Two commands: `make run` (the default demo through `flwr run .`) and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test test-fast install bench clean demo-compose

# the dependencies at the versions constraints.txt pins (docs/install.md)
$(VENV)/.installed: pyproject.toml constraints.txt
	@echo "installing dpfl and its pinned dependencies into $(VENV) (a few minutes the first time: PyTorch, Flower, Ray)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,text,blt]"
	touch $@

install: $(VENV)/.installed

# The default demo: DPSGD-GC on scikit-learn's digits, 10 virtual SuperNodes, Ray simulation.
run: install
	@echo "the demo: a local SuperLink, Ray and 10 simulated SuperNodes, 30 rounds (about a minute)"
	$(PY) -m dpfl flower
	@echo "dpfl and flwr are in $(VENV)/bin: run 'source $(VENV)/bin/activate' to put them on PATH"

# The whole suite: in parallel (pytest-xdist, JOBS workers, one a core by default; a module
# marked xdist_group runs on one worker, which builds its shared fixtures once), then the
# tests that must run alone (marker serial). test-fast: the inner loop, without real Flower
# processes, Docker, the serial tests, the reproductions' smoke runs and the tests marked slow
# (the audit's statistical fits, tests that start fresh interpreters). The suite and the
# benchmarks read the datasets from $DPFL_DATA_DIR, else from dpfl's per-user data folder
# (docs/data.md), and never download them.
JOBS ?= auto
test: install
	$(PY) -m pytest -q -n $(JOBS) --dist loadgroup -m "not serial"
	$(PY) -m pytest -q -m serial

test-fast: install
	$(PY) -m pytest -q -n $(JOBS) --dist loadgroup -m "not flower and not serial and not smoke and not slow"

bench: install
	$(PY) benchmarks/run_all.py

# The same app as a docker-compose federation (docker-compose.yml): build the image, start the
# SuperLink, three SuperNodes and their SuperExecs, run 3 rounds with `flwr run`, stop it all.
# The demo's nodes are throwaway: their ledgers (volumes node-N-state) go with them, so that the
# next demo is not refused by the nodes' ε cap.
# Without Docker Hub: BASE_IMAGE=$$(bash deploy/base-image.sh) make demo-compose
# SECURE_AGGREGATION=true: the uploads summed through Flower's SecAgg+, each client's noise
# split over the three (secure-aggregation=true distributed-noise=true)
DEMO_NAME := compose-demo-$(shell date +%Y%m%d-%H%M%S)
SECURE_AGGREGATION ?= false
DEMO_SECAGG := $(if $(filter true,$(SECURE_AGGREGATION)),secure-aggregation=true distributed-noise=true)
demo-compose: install
	mkdir -p results .flwr-compose
	printf '[superlink]\ndefault = "compose"\n\n[superlink.compose]\naddress = "127.0.0.1:9092"\ninsecure = true\n' > .flwr-compose/config.toml
	export DPFL_USER=$$(id -u):$$(id -g); docker-compose build && docker-compose up -d && \
	  until docker-compose logs superlink | grep -q "Uvicorn running"; do sleep 1; done && \
	  FLWR_HOME=$(abspath .flwr-compose) $(VENV)/bin/flwr run . compose --stream \
	    --run-config 'num-partitions=3 num-server-rounds=3 secure-noise=true $(DEMO_SECAGG) run-name="$(DEMO_NAME)"'; \
	  status=$$?; docker-compose down --remove-orphans --volumes; \
	  test $$status = 0 && echo "results in results/$(DEMO_NAME)"

clean:
	rm -rf $(VENV) results .flwr-home .flwr-compose
