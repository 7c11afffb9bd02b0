# One entry point per chore. `make up` brings the stack up; `make test` runs every test tier.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
.DEFAULT_GOAL := help
ENGINE ?= vllm
VENV := .venv
PY := $(VENV)/bin/python
PACKAGES := libs/contracts libs/examlops tools/devstack tools/testsupport services/registry services/mediaguard services/engine-proxy services/launcher services/gateway cli
STAMP := $(VENV)/.installed
export EXAMLOPS_USECASE_DIR ?= $(CURDIR)/usecases
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help up down status logs test test-fast lint protos lock bench bench-peers venv system-deps test-deps vllm-env quant-env compose-env clean

help: ## Show the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): $(foreach p,$(PACKAGES),$(p)/pyproject.toml) requirements-dev.txt
	@echo "==> Installing the services, the CLI and the test tools into $(VENV)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -m pip install --progress-bar on -q $(foreach p,$(PACKAGES),-e $(p)) -r requirements-dev.txt \
	  2> >(grep -v '^WARNING: Location' >&2)
	@touch $@

venv: $(STAMP) ## Create the virtual environment of the services, CLI and tests

# Debian packages, installed when missing: the terminal gets one `==>` line per install, apt's whole
# output goes to DEPS_LOG, and its end is shown when an install fails.
DEPS_LOG ?= .run/logs/system-deps.log
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
quietly = { mkdir -p $(dir $(DEPS_LOG)) && { $(1); } 2>&1 | tee -a $(DEPS_LOG) | { grep --line-buffered '^==>' || true; } \
  || { echo "==> Failed; the end of $(DEPS_LOG):" >&2; tail -n 40 $(DEPS_LOG) >&2; exit 1; }; }

system-deps: ## Install Redis and Prometheus (Debian packages), when missing: all the local stack needs
	@command -v redis-server >/dev/null || $(call quietly,echo "==> Installing redis-server (Debian package; log: $(DEPS_LOG))"; \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || $(call quietly,echo "==> Installing prometheus \
	  (Debian package: the server and promtool; log: $(DEPS_LOG))"; $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)

test-deps: system-deps ## Install Slurm, munge and an SSH server for the tests (Debian packages), when missing
	@$(call quietly,bash scripts/slurm-local.sh install && bash scripts/sshd-local.sh install)

vllm-env: ## Build (once, cached) the CPU vLLM environment and the SmolLM2 and MiniLM model folders
	@bash scripts/vllm-env.sh >/dev/null

quant-env: ## Build (once, cached) the quantizer environment (llm-compressor, kept apart from vLLM's)
	@bash scripts/quant-env.sh >/dev/null

up: venv system-deps ## Start two Redis, the five services and real CPU vLLMs serving SmolLM2 and MiniLM (ENGINE=echo: no vLLM)
	@bash scripts/link-exa.sh $(CURDIR)/$(VENV)/bin/exa
ifeq ($(ENGINE),echo)
	@$(PY) -m examlops_devstack up --engine echo
else
	@eval "$$(bash scripts/vllm-env.sh)" && $(PY) -m examlops_devstack up --engine vllm \
	  --vllm-venv "$$VLLM_VENV" --model-dir "$$SMOL_MODEL_DIR" --minilm-dir "$$MINILM_MODEL_DIR"
endif

down: ## Stop exactly what `make up` started
	@test -x $(PY) && $(PY) -m examlops_devstack down || true

status: ## Show each part of the local stack
	@$(PY) -m examlops_devstack status

logs: ## Follow the logs of the local stack
	@tail -n 20 -F .run/logs/*.log

test: venv test-deps vllm-env quant-env ## Run every test tier (installs what it needs; starts its own servers)
	@eval "$$(bash scripts/vllm-env.sh)" && export EXAMLOPS_VLLM_VENV="$$VLLM_VENV" EXAMLOPS_SMOL_MODEL_DIR="$$SMOL_MODEL_DIR" \
	    EXAMLOPS_MINILM_MODEL_DIR="$$MINILM_MODEL_DIR" && \
	  eval "$$(bash scripts/quant-env.sh)" && export EXAMLOPS_QUANT_VENV="$$QUANT_VENV" && \
	  $(PY) scripts/gen-protos.py --check && $(PY) -m pytest -q

test-fast: venv test-deps ## Tests without the real-vLLM tier
	@$(PY) -m pytest -q -m "not vllm"

lint: venv ## ruff and mypy --strict
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/mypy libs/*/src services/*/src cli/src tools/devstack/src

protos: venv ## Regenerate the gRPC stubs from protos/
	@$(PY) scripts/gen-protos.py

lock: venv ## Recompile every service image's hashed lock (services/<name>/requirements.lock; needs PyPI)
	@$(PY) scripts/lock_images.py

bench: venv system-deps ## Gateway overhead, governance's, the response cache's, replica routing's and tracing's added cost, against in-run baselines; one gateway worker against two
	@$(PY) bench/bench_gateway.py
	@$(PY) bench/bench_governance.py
	@$(PY) bench/bench_cache.py
	@$(PY) bench/bench_routing.py
	@$(PY) bench/bench_tracing.py
	@$(PY) bench/bench_workers.py

bench-peers: venv system-deps ## LiteLLM's proxy, a plain proxy and ours in front of one stub, pinned (installs LiteLLM once)
	@out="$$(bash scripts/litellm-env.sh)" && eval "$$out" && $(PY) bench/bench_peers.py --litellm-venv "$$LITELLM_VENV"

compose-env: ## Write fresh secrets (admin key, internal tokens, vLLM key) into ./.env for docker compose (0600; keeps existing ones)
	@python3 scripts/compose_env.py

clean: down ## Remove the local stack state and the virtual environment
	rm -rf .run $(VENV)
