#!/usr/bin/env bash
# What a session with a lent GPU runs, in one call: the GPU benchmark (bench/gpu_throughput.py: raylora's
# LoRA step against the HF Trainer's on an 8B-size Qwen3-VL) and raylora's GPU checks (`make gpu-check`,
# tests/test_gpu.py), each under a time limit of its own, logs and results under $OUT.
#
#   bash bench/gpu_session.sh [all|bench|check]      # all (the default): the benchmark, then the checks
#
# One call of the device tool runs 10 minutes at most: `all` gives the benchmark BENCH_S (default 330 s) and
# the checks what is left of TOTAL_S (default 570 s); where the checks need longer (a dozen 2-worker Ray
# runs), run `check` in a second call. Environment:
#   PY      a Python with raylora's pins (pyproject.toml: torch and torchvision, transformers 5.23, peft,
#           deepspeed, ray[train], accelerate, datasets) that sees CUDA; default .venv/bin/python, else
#           python3. A missing package or no GPU stops the script at once, before any GPU work.
#   OUT     where the logs, gpu_throughput.json and nvidia-smi's report go (default bench/results/gpu-session);
#           the figures to keep are bench/results/gpu_throughput.json: copy that file there from OUT
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case $what in all | bench | check) ;; *) echo "usage: $0 [all|bench|check]" >&2; exit 2 ;; esac
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${OUT:-bench/results/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
started=$SECONDS

"$PY" - <<'PY' 2>&1 | tee "$OUT/environment.txt" || exit 2
import importlib.util
import sys

need = ["torch", "torchvision", "transformers", "peft", "deepspeed", "ray", "accelerate", "datasets", "pytest"]
missing = [name for name in need if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"gpu_session: {sys.executable} lacks {', '.join(missing)} (pyproject.toml's pins)")
import torch
import transformers

if not torch.cuda.is_available():
    sys.exit("gpu_session: torch sees no CUDA device")
print(f"{torch.cuda.get_device_name(0)}: torch {torch.__version__}, transformers {transformers.__version__}")
PY
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

status=0
if [ "$what" != check ]; then
  timeout "${BENCH_S:-330}" "$PY" bench/gpu_throughput.py --out "$OUT" 2>&1 | tee "$OUT/gpu_throughput.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "gpu_session: the benchmark ran out of its ${BENCH_S:-330} s" | tee -a "$OUT/gpu_throughput.log"
  [ "$rc" = 0 ] || status=1
fi
if [ "$what" != bench ]; then
  left=$(( ${TOTAL_S:-570} - (SECONDS - started) ))
  [ "$what" = check ] && left=${TOTAL_S:-570}
  timeout "$left" "$PY" -m pytest -v -rs -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu-check.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "gpu_session: the checks ran out of their $left s" | tee -a "$OUT/gpu-check.log"
  [ "$rc" = 0 ] || status=1
fi
exit $status
