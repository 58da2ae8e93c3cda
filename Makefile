# dtrain make targets. `make help` lists them; `make train` and `make test` set up what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DTRAIN := $(VENV)/bin/dtrain
TORCH_PIN := torch==2.13.0
# The oldest torch dtrain supports (pyproject.toml's floor); make test-compat runs the compat tier on it.
COMPAT_VENV ?= .venv-compat
TORCH_FLOOR := torch==2.11.0
# What training needs (make train, sweep, report) and what the tests add (make test, test-all, lint):
# a user who only trains gets no transformers, lm-eval, trackers or linters.
TRAIN_EXTRAS := plot
TEST_EXTRAS := dev,test,plot,stats,tensorboard,export,harness,wandb,mlflow,optuna,tokenizers,fineweb,float8
SMOKE := model=tiny train.max_steps=6 optim.warmup_steps=2 train.log_interval=1 train.val_interval=3 train.val_tokens=512 \
         train.micro_batch_size=4 train.seq_len=64 train.sample_tokens=16 train.progress=false

.PHONY: help setup setup-test setup-compat train sweep report test test-all test-compat lint image clean smoke smoke-none smoke-dp smoke-ddp smoke-zero smoke-fsdp bench bench-gpu gpu-bundle chaos

help: ## list every target with one line each
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

setup: $(VENV)/.installed-train ## make .venv for training: torch==2.13.0 first, then dtrain and matplotlib (idempotent)

$(VENV)/.installed-train: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned resolve on a CPU machine pulls GBs of CUDA wheels
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[$(TRAIN_EXTRAS)]'
	touch $@

setup-test: $(VENV)/.installed ## add what the tests use to .venv: linters, transformers, lm-eval, trackers, optuna

$(VENV)/.installed: $(VENV)/.installed-train
	$(PY) -m pip install --quiet -e '.[$(TEST_EXTRAS)]'
	touch $@

setup-compat: $(COMPAT_VENV)/.installed ## make .venv-compat: the floor torch (2.11.0, PyPI's default build) and what the compat tier needs

$(COMPAT_VENV)/.installed: pyproject.toml Makefile
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet $(TORCH_FLOOR)
	$(COMPAT_VENV)/bin/python -m pip install --quiet -e '.[export,tokenizers]' 'pytest>=8'
	touch $@

train: setup ## train a small GPT on the embedded Shakespeare dataset (experiment=shakespeare_cpu, ~3.5 min on 2 cores)
	$(DTRAIN) train experiment=shakespeare_cpu $(ARGS)

sweep: setup ## a two-point learning-rate sweep of the tiny model, each point a DDP run at world 2 (multirun/optim.lr-<digest>/; run again, it continues)
	$(DTRAIN) train -m model=tiny train.max_steps=40 train.log_interval=2 train.val_interval=10 \
	    train.micro_batch_size=4 train.seq_len=64 train.sample_tokens=0 train.progress=false \
	    'optim.lr=1e-3,3e-3' parallel=ddp world=2 $(ARGS)

report: setup ## PNG plots + a table of the latest sweep or run (or RUN=DIR); the files go into that folder
	@dir="$(RUN)"; \
	if [ -z "$$dir" ]; then \
	    latest=$$(ls -t multirun/*/summary.jsonl multirun/*/*/summary.jsonl outputs/*/metrics.jsonl outputs/*/*/metrics.jsonl 2>/dev/null | head -n 1); \
	    [ -n "$$latest" ] && dir=$$(dirname "$$latest"); \
	fi; \
	if [ -z "$$dir" ]; then echo "no sweep or run under multirun/ or outputs/ yet: make train or make sweep first, or make report RUN=DIR" >&2; exit 2; fi; \
	echo "$(DTRAIN) report $$dir $(ARGS)"; $(DTRAIN) report "$$dir" $(ARGS)

# pytest-xdist: one test process per core (TEST_WORKERS=0: all in one process, for pdb or -s). A
# module's tests stay in one process (--dist loadfile), so its shared reference runs are made once.
TEST_WORKERS ?= auto
PARALLEL_TESTS = -n $(TEST_WORKERS) --dist loadfile

test: setup-test ## the quick tier: unit tests + one real multi-process test per parallel mode and fault class
	$(VENV)/bin/pytest -q $(PARALLEL_TESTS) -m "not slow" $(ARGS)

test-all: setup-test ## every test (what CI runs), the 20 slowest listed at the end
	$(VENV)/bin/pytest -q $(PARALLEL_TESTS) --durations=20 $(ARGS)

test-compat: setup-compat ## the compatibility tier (pytest -m compat) on the floor torch in .venv-compat
	$(COMPAT_VENV)/bin/python -m pytest -q -m compat $(ARGS)

lint: setup-test ## ruff, the import layers (import-linter: pyproject.toml), dead code (vulture)
	$(VENV)/bin/ruff check trainer tests scripts
	$(VENV)/bin/lint-imports
	$(VENV)/bin/vulture trainer --min-confidence 80

smoke: smoke-none smoke-dp smoke-ddp smoke-zero smoke-fsdp ## a few steps of every parallel mode
smoke-none: setup ## a few steps, one process
	$(DTRAIN) train $(SMOKE) parallel=none hydra.run.dir=outputs/smoke/none-$$(date +%s%N)
smoke-dp: setup ## a few steps under nn.DataParallel
	$(DTRAIN) train $(SMOKE) parallel=dp hydra.run.dir=outputs/smoke/dp-$$(date +%s%N)
smoke-ddp: setup ## a few steps of DDP, world 2
	$(DTRAIN) train $(SMOKE) parallel=ddp world=2 hydra.run.dir=outputs/smoke/ddp-$$(date +%s%N)
smoke-zero: setup ## a few steps of DDP + ZeRO, world 2
	$(DTRAIN) train $(SMOKE) parallel=zero world=2 hydra.run.dir=outputs/smoke/zero-$$(date +%s%N)
smoke-fsdp: setup ## a few steps of FSDP2, world 2
	$(DTRAIN) train $(SMOKE) parallel=fsdp world=2 hydra.run.dir=outputs/smoke/fsdp-$$(date +%s%N)

chaos: setup ## faults caused for real on a ddp world-2 run (worker SIGKILL, driver SIGTERM, corrupt checkpoint, non-finite rollback) and the verdict
	$(PY) scripts/chaos.py $(ARGS)

bench: setup ## tokens/s, step-time split and memory per rank for each parallel mode (ARGS="--model cpu16m --vs-bare ...")
	$(PY) scripts/bench.py $(ARGS)

bench-gpu: setup ## dtrain vs a bare loop on one GPU, Muon, Lion, a mixture, memory vs plan, every mode at world 1 (<= 8 min; exit 2 without CUDA)
	$(PY) scripts/bench_gpu.py $(ARGS)

gpu-bundle: setup ## .whl/ and .device/: the wheels, vocabulary and data a GPU machine without network needs for scripts/gpu_session.sh
	PY=$(PY) bash scripts/gpu_bundle.sh

IMAGE ?= dtrain:0.1.0
TORCH_VARIANT ?= cpu
image: ## the container image scripts/k8s/ runs (IMAGE=REGISTRY/dtrain:TAG, TORCH_VARIANT=cpu or a CUDA one, e.g. cu128); needs Docker
	docker build --build-arg TORCH_VARIANT=$(TORCH_VARIANT) --tag $(IMAGE) .

clean: ## remove run outputs and caches (not .venv, not prepared data)
	rm -rf outputs multirun .pytest_cache .ruff_cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
