# pd-middleware developer entry points. Everything runs inside .venv in the repo root.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0

.PHONY: setup lint demo test bench reliability reliability-quick setup-sglang test-sglang setup-server test-server server-demo clean

# Create or update .venv: system library check, torch (CPU) if absent, the Mooncake
# wheel that fits this machine, the project with its test extras and the plugin
# distributions under plugins/, and the example third-party plugin (examples/, docs/plugins.md).
setup:
	@ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "setup: installing libibverbs1 (needed by the Mooncake engine)"; \
	    (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null; \
	  else echo "setup: the Mooncake engine needs libibverbs1: sudo apt-get install libibverbs1"; exit 1; fi; }
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || { echo "setup: installing $(TORCH) (CPU)"; $(PIP) install -q $(TORCH); }
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then mc=mooncake; else mc=mooncake-cpu; fi; \
	  $(PIP) install -q -e ".[test,lint,$$mc]" -e plugins/pd-middleware-full -e examples/pd-middleware-example-plugin
	@echo "setup: $(VENV) ready"

# Lint and types (pyproject.toml: [tool.ruff], [tool.mypy]): ruff's rules, ruff's format
# (checked, never rewritten here) and mypy strict on pd_middleware/ and plugins/.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

demo: setup
	$(VENV)/bin/pd-middleware ab configs/ab.toml

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/run_all.py

reliability: setup
	$(PY) reliability/run_all.py

reliability-quick: setup
	$(PY) reliability/run_all.py --quick

# Optional tier: the real SGLang package (CPU import only), for tests marked `sglang`.
setup-sglang: setup
	$(PIP) install -q --no-deps -r requirements-sglang.txt

test-sglang: setup-sglang
	$(PY) -m pytest -q -m sglang

# Server tier: real SGLang servers (a PD pair with EAGLE3 and rejection sampling, and
# sglang-router) started on this CPU machine, for tests marked `server` (docs/server.md).
setup-server: setup-sglang
	$(PIP) install -q --no-deps -r requirements-server.txt

# PDM_SERVER_MODELS: a folder with target/ and eagle3/ (else tests/server/models/build.py).
test-server: setup-server
	$(PY) -m pytest -q -m server tests/server -rsP

# A PD pair with the drop-in behind a router on this laptop (docs/server.md).
server-demo: setup-server
	$(PY) -m tests.server.demo

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
