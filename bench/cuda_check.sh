#!/usr/bin/env bash
# The torch engine on CUDA, checked on a real GPU in one short run (issue 45; under 8 minutes on an H100):
#   1. the CUDA-marked tests (tests/unit/test_cuda_gpu.py): greedy parity with the CPU engine for 32 tokens on
#      SmolLM2-135M (bf16) and a random Llama 3.2 1B-shaped model (f32), paged attention against a dense cache,
#      the int4/int8 kernels and engines, a CUDA + CPU Pipeline over gloo;
#   2. bench/cuda_bench.py: decode (1 stream, 32 streams) and prefill tok/s per format (bf16, int8, int4) against
#      the device's memory bandwidth.
# Usage, from the repository root: bench/cuda_check.sh   (PYTHON=... to pick the interpreter; default .venv's)
# Needs the CUDA build of torch (make run CUDA=1) and SmolLM2's GGUF in the model cache (fetched once by
# `make run`, or SKULK_MODEL_CACHE pointing at a copy) for the SmolLM2 tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)

echo "== GPU and torch"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
"$PYTHON" - <<'PY'
import torch
print(f"torch: {torch.__version__}  cuda: {torch.version.cuda}  cuda_available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible to torch: install the CUDA build (make run CUDA=1) on a GPU machine")
props = torch.cuda.get_device_properties(0)
print(f"gpu: {props.name}  memory_GiB: {props.total_memory / 2**30:.1f}  capability: {props.major}.{props.minor}")
PY

echo "== parity and paged-attention tests on CUDA (tests/unit/test_cuda_gpu.py)"
set +e
timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider -n 0 -m cuda -rA -s --tb=short tests/unit/test_cuda_gpu.py
tests_rc=$?
set -e
echo "tests_exit: $tests_rc  tests_seconds: $(( $(date +%s) - started ))"

echo "== decode and prefill against the memory bandwidth (bench/cuda_bench.py)"
set +e
timeout 170 "$PYTHON" bench/cuda_bench.py --tokens 64 --streams 32 --prefill 512
bench_rc=$?
set -e
echo "bench_exit: $bench_rc  total_seconds: $(( $(date +%s) - started ))"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
