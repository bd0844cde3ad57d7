# fuser: `make demo` runs the main job, `make test` the tests. Both set up .venv on first use.
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
TRITON_VERSION ?= 3.6.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all lint format docs bench bench-report clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) triton==$(TRITON_VERSION)
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) examples/demo.py

test: $(STAMP)
	$(PYTHON) -m pytest -q -n logical --durations=20

test-all: $(STAMP)  # every item of every sweep (tests/README.md): an hour or more on two cores
	FUSER_TEST_ALL=1 $(PYTHON) -m pytest -q -n logical --durations=20

lint: $(STAMP)
	$(PYTHON) -m ruff check fuser tests examples benchmarks
	$(PYTHON) -m ruff format --check fuser tests examples benchmarks

format: $(STAMP)
	$(PYTHON) -m ruff format fuser tests examples benchmarks

docs: $(STAMP)  # the site from docs/ into site/ (mkdocs-material, strict: no broken link)
	$(PYTHON) -m mkdocs build --strict

DATE := $(shell date +%F)
RESULTS := benchmarks/results

# The benchmarks behind the README's performance table (needs a CUDA GPU; anchors that do
# not import are rows saying so). Results under benchmarks/results/, the summary in
# latest.json, then benchmarks/RESULTS.md and results/latest.png from it.
bench: $(STAMP)
	$(PYTHON) benchmarks/optim_bench.py llama1b small1000 lamb --compile
	$(PYTHON) benchmarks/state_bench.py  # anchors (FlashOptim, bitsandbytes, torchao) when importable
	$(PYTHON) benchmarks/shaped_bench.py
	$(PYTHON) benchmarks/muon_bench.py
	$(PYTHON) benchmarks/loss_bench.py gist llama8b --options --no-compile --tag _options
	$(PYTHON) benchmarks/loss_bench.py gist llama8b --lean --ignore7
	$(PYTHON) benchmarks/post_training_bench.py
	$(PYTHON) benchmarks/precond_bench.py
	$(PYTHON) benchmarks/first_step.py --modes fuser-cold fuser-warm fuser-precompiled torch-fused
	$(PYTHON) benchmarks/scaling.py
	$(PYTHON) benchmarks/latest.py $(RESULTS)/optim_$(DATE).json $(RESULTS)/state_$(DATE).json \
		$(RESULTS)/shaped_$(DATE).json $(RESULTS)/muon_$(DATE).json $(RESULTS)/loss_$(DATE)_options.json \
		$(RESULTS)/loss_$(DATE).json $(RESULTS)/post_training_$(DATE).json $(RESULTS)/precond_$(DATE).json \
		$(RESULTS)/first_step_$(DATE)_llama1b_fp32.json
	$(MAKE) bench-report

# RESULTS.md and the plot from the latest.json that is there (any machine; the plot needs matplotlib)
bench-report: $(STAMP)
	$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PYTHON) -m pip install -q -e '.[bench]'
	$(PYTHON) benchmarks/results_md.py $(RESULTS)/latest.json --out benchmarks/RESULTS.md
	$(PYTHON) benchmarks/plot.py $(RESULTS)/latest.json --out $(RESULTS)/latest.png

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .ruff_cache
