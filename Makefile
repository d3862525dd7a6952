# Two commands for a fresh machine (see README.md):
#   make run    installs everything into .venv, then serves the demo model and queries it
#   make test   installs everything into .venv, then runs lint, type checks and the whole test suite (what CI runs)
# and, while working: make test-fast   the fast tier of the tests only (tests/tiers.py), a few minutes
#                    make test-as-avx2  every test as on an AVX2-only CPU, on a wider one (tests/cpu_emulation)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast test-as-avx2 lint test-tools

# The C++ kernels are built here (announced, one line per compiled source; minutes the first time, cached in
# ~/.cache/moeserve/kernels afterwards) so that the first `serve` does not. Without a compiler the engine runs
# torch's ops: setup goes on.
setup: $(STAMP)
	@$(VENV)/bin/moeserve build-kernels || echo "make setup: going on without the C++ kernels (see above)"

# torch first, pinned to 2.13.0. Which build that is depends on where pip finds it: a local CPU wheel where one is
# provided (PIP_FIND_LINKS), else PyPI's, which on Linux x86_64 is the CUDA build. TORCH_INDEX picks an index:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu     (no GPU: the CPU wheel, no CUDA libraries)
TORCH_INDEX ?=
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: setup
	$(PY) scripts/demo.py

lint: setup
	$(VENV)/bin/ruff check moeserve tests scripts research
	$(VENV)/bin/mypy moeserve

# The aarch64 cross compiler and qemu-user of tests/kernels/test_aarch64_qemu.py (the canonical kernels built for
# aarch64 and run under emulation): installed with apt-get when missing and apt-get is usable (CI: a fresh Debian
# machine, as root; 66 MB, ~20-30 s), else said why, and those tests skip. Idempotent (present: one line); never
# fails the run nor hangs it (apt-get bounded by timeout, its failure said and ignored).
CROSS_TOOLS := g++-aarch64-linux-gnu qemu-user
HAVE_CROSS_TOOLS := command -v aarch64-linux-gnu-g++ >/dev/null && \
  { command -v qemu-aarch64 >/dev/null || command -v qemu-aarch64-static >/dev/null; }
test-tools:
	@if $(HAVE_CROSS_TOOLS); then \
	  echo "make test-tools: aarch64 cross compiler and qemu-aarch64 present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "make test-tools: installing $(CROSS_TOOLS) with apt-get (for tests/kernels/test_aarch64_qemu.py)"; \
	  t0=$$(date +%s); \
	  if timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq \
	      --no-install-recommends $(CROSS_TOOLS) >/dev/null && $(HAVE_CROSS_TOOLS); then \
	    echo "make test-tools: installed in $$(( $$(date +%s) - t0 )) s"; \
	  else \
	    echo "make test-tools: the install failed (see above) or left no aarch64-linux-gnu-g++ / qemu-aarch64:" \
	      "tests/kernels/test_aarch64_qemu.py will skip"; \
	  fi; \
	else \
	  echo "make test-tools: no aarch64-linux-gnu-g++ / qemu-aarch64 and apt-get is not usable here (not root, or no apt-get):" \
	    "tests/kernels/test_aarch64_qemu.py will skip (install $(CROSS_TOOLS) to run it)"; \
	fi

test: lint test-tools
	bash scripts/run_tests.sh $(PY)

# The tests not marked slow (tests/tiers.py says which are), without lint and type checks (make lint).
test-fast: setup
	bash scripts/run_tests.sh $(PY) fast

# Every test as on an AVX2-only CPU (one of CI's machines), on a wider x86 one: our kernels built for avx2, ATen's
# avx2 kernels, oneDNN off (tests/cpu_emulation). TIER=fast for the fast tier only.
TIER ?= all
test-as-avx2: setup test-tools
	TESTS_EMULATE_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 bash scripts/run_tests.sh $(PY) $(TIER)
