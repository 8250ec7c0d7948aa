PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install targets train test test-all notebooks ci-share ci-share-next bench peers clean

# The package and what training needs (jax, flax, optax, orbax, ...; no torch): ~0.9 GB
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $(STAMP)

# The test extra (pytest, torch CPU, transformers, pyarrow, grain, datasets, nbclient, ...): ~1.4 GB more
TESTS := $(VENV)/.tests-installed

$(TESTS): $(STAMP)
	$(BIN)/pip install -q -e ".[test]"
	touch $(TESTS)

# Jupyter, to open the notebooks: `make notebooks`, then .venv/bin/jupyter lab notebooks/
NOTEBOOKS := $(VENV)/.notebooks-installed

$(NOTEBOOKS): $(STAMP)
	$(BIN)/pip install -q -e ".[notebooks]"
	touch $(NOTEBOOKS)

# The GPU and TPU compilers (docs/targets.md): ~1.3 GB, for the tests and `jaxpar inspect --target`;
# `make train` does not need them. They go into a directory of their own, off sys.path
# (.venv/jaxpar-targets: jaxpar.devices.targets_dir), so that `import jax` does not load them.
TARGETS := $(VENV)/.jaxpar-targets-installed

$(TARGETS): $(STAMP)
	cmd="$$($(BIN)/python -c 'from jaxpar.devices import install_command; print(install_command())')" && eval "$$cmd -q"
	touch $(TARGETS)

install: $(STAMP)

targets: $(TARGETS)

train: $(STAMP)
	$(BIN)/jaxpar train configs/quickstart.yaml $(ARGS)

# one pytest worker per core (at most 4), a test file per worker: the compiles are single-threaded
PARALLEL := -n auto --maxprocesses=4 --dist loadfile --no-loadscope-reorder
# A run ends: a test that crashes its worker fails once, by name, and one that hangs ends its worker after
# 600 s (tests/conftest.py; docs/testing.md, "A suite that ends"). TEST_TIMEOUT (seconds, 0: none) bounds
# the whole run too, for a hang outside any test (where coreutils' timeout is installed).
TEST_TIMEOUT ?= 3600
PYTEST = $(if $(shell command -v timeout),timeout --foreground --kill-after=60 $(TEST_TIMEOUT)) $(BIN)/python -m pytest
TIMED_OUT = || { s=$$?; [ $$s -ne 124 ] || echo "make $@: stopped after TEST_TIMEOUT=$(TEST_TIMEOUT) s"; exit $$s; }

test: $(TESTS) $(TARGETS)
	$(PYTEST) -q $(PARALLEL) $(TIMED_OUT)

test-all: $(TESTS) $(TARGETS)
	$(PYTEST) -q $(PARALLEL) -m "" $(TIMED_OUT)

notebooks: $(NOTEBOOKS)
	@echo "open them with: $(BIN)/jupyter lab notebooks/  (figures they save go to notebooks/*.png, git-ignored)"

# the share of the exhaustive tier CI runs at HEAD; `make ci-share-next` advances it, once per session, in the
# session's first commit (docs/testing.md §1)
ci-share:
	@.ci/share

ci-share-next:
	@.ci/share next

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/collectives.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/compile_time.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/byo_model.py
	$(BIN)/python benchmarks/gradient_compression.py
	$(BIN)/python benchmarks/compression_convergence.py

# Levanter's own venv for benchmarks/peers/levanter.py (docs/benchmarks.md): Python 3.11, pinned
PEERS := benchmarks/peers/.venv-levanter
peers:
	test -d $(PEERS) || python3.11 -m venv $(PEERS)
	$(PEERS)/bin/pip install -q -r benchmarks/peers/requirements-levanter.txt

clean:
	rm -rf $(VENV) runs .pytest_cache
