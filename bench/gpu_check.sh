#!/usr/bin/env bash
# One GPU check for the Triton path (issue 8), under 5 minutes on one GPU:
#   1. the Triton kernel tests, compiled on CUDA (KVGUARD_TEST_DEVICE=cuda);
#   2. bench/gpu_kernels.py: kernel time, bandwidth vs copy bandwidth, ratio to dense SDPA for
#      SmolLM2 and Llama-2-7B shapes at batch 64, contexts 1k/4k/16k; smollm2-135m end to end
#      with KVGUARD_TRITON=0 vs 1 (needs the converted model under $KVGUARD_HOME; the GPU
#      machine cannot download it, so without it that part reports an error and the rest stands).
#   3. with two or more GPUs visible: bench/tensor_parallel.py, tiny at tp=1 vs tp=2 over NCCL.
#   4. the W4A16 GEMM (issue 15): its tests compiled on CUDA, then bench/gpu_w4a16.py, Llama-2-7B
#      layer shapes at batch 1/16/64/256 against fp16 torch.matmul (about a minute, mostly
#      Triton compiles).
# Results land in ${OUT:-bench/out}/gpu_kernels.json, gpu_w4a16.json and on stdout.
#
#   bench/gpu_check.sh              # on a CUDA host
#   bench/gpu_check.sh --cpu-smoke  # no GPU: tiny shapes in the Triton interpreter
# PY overrides the interpreter (default .venv/bin/python, else python3); it needs torch (CUDA
# build on a GPU host), triton, pytest, and kvguard installed (`pip install -e .`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT_DIR=${OUT:-bench/out}
mkdir -p "$OUT_DIR"

if ! "$PY" -c "import kvguard.kernels" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . >/dev/null
fi

if [[ "${1:-}" == "--cpu-smoke" ]]; then
  TRITON_INTERPRET=1 timeout 300 "$PY" bench/gpu_kernels.py --cpu-smoke --json "$OUT_DIR/gpu_kernels_smoke.json"
  TRITON_INTERPRET=1 timeout 120 "$PY" bench/gpu_w4a16.py --cpu-smoke --json "$OUT_DIR/gpu_w4a16_smoke.json"
  exit
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

status=0
echo "== Triton kernel tests on CUDA"
KVGUARD_TEST_DEVICE=cuda timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py || status=1

echo "== kernel benchmark and end to end"
timeout 240 "$PY" bench/gpu_kernels.py --json "$OUT_DIR/gpu_kernels.json" || status=1

# 3. tensor parallel over NCCL, one GPU per rank: the tiny model (written locally, nothing to
#    download) at tp=1 and tp=2, same tokens required. Runs only where two GPUs are visible.
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if (( ngpu >= 2 )); then
  echo "== tensor parallel 2 on CUDA (NCCL)"
  timeout 180 "$PY" bench/tensor_parallel.py --quick --device cuda --pairs tiny:2 \
    --json "$OUT_DIR/tensor_parallel.json" || status=1
else
  echo "== tensor parallel: not run, $ngpu GPU visible (needs 2)"
fi

echo "== W4A16 GEMM: tests on CUDA, then Llama-2-7B layer shapes vs fp16 torch.matmul"
KVGUARD_TEST_DEVICE=cuda timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_w4a16.py || status=1
timeout 150 "$PY" bench/gpu_w4a16.py --json "$OUT_DIR/gpu_w4a16.json" || status=1
exit $status
