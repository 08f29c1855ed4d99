# pd-middleware developer entry points. Everything runs inside .venv in the repo root.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0

.PHONY: setup lint demo test test-wheel bench reliability reliability-quick setup-sglang test-sglang setup-server setup-releases test-server test-releases server-demo clean

# Create or update .venv: system library check, torch (CPU) if absent, the Mooncake
# wheel that fits this machine, the project with its test extras (its first-party plugins,
# the full-distribution pair included, ship in it), and the example third-party plugin
# (examples/, docs/plugins.md). The full pair was once its own distribution
# (pd-middleware-full): an older .venv has it uninstalled, or it would shadow the core's.
setup:
	@ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "setup: installing libibverbs1 (needed by the Mooncake engine)"; \
	    (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null; \
	  else echo "setup: the Mooncake engine needs libibverbs1: sudo apt-get install libibverbs1"; exit 1; fi; }
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || { echo "setup: installing $(TORCH) (CPU)"; $(PIP) install -q $(TORCH); }
	@! $(PIP) show -q pd-middleware-full 2>/dev/null || $(PIP) uninstall -q -y pd-middleware-full
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then mc=mooncake; else mc=mooncake-cpu; fi; \
	  $(PIP) install -q -e ".[test,lint,$$mc]" -e examples/pd-middleware-example-plugin
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

# The one-install bar (tests/test_wheel.py, marker `wheel`): a wheel built from a clean
# checkout (git HEAD), installed by pip with its dependencies into a fresh venv that has
# only torch, runs `pd-middleware ab --requests 50` from an empty directory. Needs the
# package index (pip's configured one) and a few minutes.
test-wheel: setup
	$(PY) -m pytest -q -m wheel tests/test_wheel.py

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

# Older SGLang releases for the per-release modules (tests/server/test_release.py,
# docs/server.md): one folder per release, .venv-releases/<v>/, from
# requirements-releases/<v>.txt with --no-deps (sglang==<v> and the pins where it differs
# from the venv); the tier puts it first on the servers' PYTHONPATH, on top of the server
# tier's venv (env PDM_SGLANG_RELEASES names the parent folder). A folder whose requirements
# copy matches is kept as is, so a second run does nothing. The releases install side by
# side (each into its own folder; mostly download time), and any failure fails the target.
RELEASES     ?= 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22
RELEASES_DIR ?= .venv-releases
setup-releases: setup-server
	@pids=""; for v in $(RELEASES); do \
	  req=requirements-releases/$$v.txt; dir=$(RELEASES_DIR)/$$v; \
	  if cmp -s $$req $$dir/.requirements; then continue; fi; \
	  echo "setup-releases: SGLang $$v into $$dir"; rm -rf $$dir; \
	  ( $(PIP) install -q --no-deps --target $$dir -r $$req && cp $$req $$dir/.requirements \
	    || { echo "setup-releases: SGLang $$v failed"; exit 1; } ) & pids="$$pids $$!"; \
	done; rc=0; for p in $$pids; do wait $$p || rc=1; done; exit $$rc

# PDM_SERVER_MODELS: a folder with target/ and eagle3/ (else tests/server/models/build.py).
# The per-release modules are left to test-releases (they skip without their folders), and
# so is test_recompute_tp2's 0.5.21 decode (its id v0521).
test-server: setup-server
	$(PY) -m pytest -q -m server tests/server -rsP --durations=25 --deselect tests/server/test_release.py -k "not v0521"

# Each older SGLang release: the drop-in against its real modules, one interpreter per
# release (tests/test_sglang_releases.py, which test-sglang runs before these folders
# exist), then in a real PD pair (tests/server/test_release.py, docs/server.md), and the
# overlapped TP 2 decode on 0.5.21 (tests/server/test_recompute_tp2.py's v0521), and SGLang's
# own resolution of the tier's flags per release with and without overlap_spec_cpu.
test-releases: setup-releases
	PDM_SGLANG_RELEASES=$${PDM_SGLANG_RELEASES:-$(RELEASES_DIR)} $(PY) -m pytest -q -m "sglang or server" tests/test_sglang_releases.py tests/server/test_release.py tests/server/test_recompute_tp2.py tests/server/test_cpu_gaps.py::test_sglang_turns_the_overlap_schedule_off_on_cpu_without_the_override -k "not v0523" -rsP --durations=25

# A PD pair with the drop-in behind a router on this laptop (docs/server.md).
server-demo: setup-server
	$(PY) -m tests.server.demo

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
