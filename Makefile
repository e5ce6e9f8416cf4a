# raylora: every command in the README goes through these targets.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-fast bench-smoke gpu-check gpu-bench gpu-session lint format bench docs

install: $(VENV)/.installed

# torch and torchvision are installed first, pinned together (pyproject.toml says why): PyPI's build of
# torch 2.14.1 is a CUDA 13.0 build that also runs on CPUs, so CI and GPU nodes run the same wheels.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: install
	$(VENV)/bin/raylora demo

test: install
	$(PY) -m pytest -q --durations=15 -m "not bench"

# Every benchmark script at its --tiny size (tests/test_bench.py, about 5 minutes on 2 cores): a check that
# each works end to end, run before `make bench` and after changing bench/.
bench-smoke: install
	$(PY) -m pytest -q -m bench tests/test_bench.py

# The GPU path on CUDA devices (NCCL, bf16, a kill and a resume): one line per check; skipped without CUDA.
gpu-check: install
	$(PY) -m pytest -v -rs -m gpu tests/test_gpu.py

# One CUDA GPU, under 8 minutes: raylora's LoRA step against the HF Trainer's (PEFT, DeepSpeed ZeRO-3) on an
# 8B-size Qwen3-VL, tokens per second and MFU, to bench/results/gpu_throughput.json.
gpu-bench: install
	$(PY) bench/gpu_throughput.py

# A machine with a lent GPU, in one call: gpu-bench, then gpu-check, each under a time limit; no install
# (such a machine reaches no package index): PY names a Python with raylora's pins (bench/gpu_session.sh).
gpu-session:
	bash bench/gpu_session.sh

# The docs site (MkDocs with Material) into site/, warnings as errors. The config reference page is generated
# from raylora/config.py first; tests/test_shipped_configs.py fails when the committed page differs.
docs: install
	$(PY) dev/config_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# Benchmarks, side by side in one run: each script writes its JSON (and scale.png) to bench/results/.
bench: install
	$(PY) bench/checkpoint_size.py
	$(PY) bench/restore_collectives.py
	$(PY) bench/restore_bytes.py
	$(PY) bench/checkpoint_stall.py
	$(PY) bench/eval_gather.py
	$(PY) bench/save_collectives.py
	$(PY) bench/throughput.py
	$(PY) bench/recovery.py
	$(PY) bench/scale.py
	$(PY) bench/on_paper.py
	$(PY) bench/memory.py
	$(PY) bench/pipeline.py
	$(PY) bench/data_scale.py
	$(PY) bench/padding.py

lint: install
	$(VENV)/bin/ruff check raylora tests bench jobs dev
	$(VENV)/bin/ruff format --check raylora tests bench jobs dev

format: install
	$(VENV)/bin/ruff check --fix raylora tests bench jobs dev
	$(VENV)/bin/ruff format raylora tests bench jobs dev
