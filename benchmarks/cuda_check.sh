#!/usr/bin/env bash
# The CUDA checks, as one script for a GPU machine that has torch but not this repo's venv
# (e.g. the device tool: python3 with CUDA torch; pydantic carried as wheels in .whl/, fetched
# beforehand with: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
#   --platform manylinux2014_x86_64 -d .whl pydantic pydantic_core annotated-types typing-inspection
# with the versions of the venv's pip list).
#   bash benchmarks/cuda_check.sh [OUT_DIR]
# 1. tests/test_cuda.py plus the async and copy tests, on a machine where CUDA is present;
# 2. bench_async.py --device cuda: every mechanism training on the GPU, 3 reps (about 5 min on an
#    H200 at the default 100M parameters; BENCH_PARAMS_M, BENCH_BATCH, BENCH_REPEATS, BENCH_ONLY
#    and BENCH_TIMEOUT change it).
set -u
out=${1:-${OUT:-bench-results}}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 - <<'PY' 2>&1 | tee -a "$out/gpu.txt"
import time, torch
print("torch", torch.__version__, "cpus", torch.get_num_threads())
x = torch.randn(1 << 28, device="cuda")  # 1 GiB
for pinned in (True, False):
    h = torch.empty(x.shape, dtype=x.dtype, pin_memory=pinned)
    h.copy_(x); torch.cuda.synchronize()
    t = time.perf_counter(); h.copy_(x, non_blocking=pinned); torch.cuda.synchronize()
    print(f"D2H 1 GiB {'pinned' if pinned else 'pageable'}: {1 / (time.perf_counter() - t):.1f} GiB/s")
PY
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_async_save.py \
  tests/test_host_copy.py 2>&1 | tee "$out/tests.txt" | tail -40
echo "tests exit ${PIPESTATUS[0]}"
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_async.py --device cuda \
  --params-m "${BENCH_PARAMS_M:-100}" --batch "${BENCH_BATCH:-8192}" \
  --steps 16 --every 8 --base-steps 8 --repeats "${BENCH_REPEATS:-3}" --only "${BENCH_ONLY:-copy,dcp,dcp_async,dcp_async_stager,resurgo,resurgo_async,resurgo_async_guard}" \
  --out "$out/async_cuda.json" --workdir /tmp/resurgo-bench 2>&1 | tee "$out/bench.txt"
echo "bench exit ${PIPESTATUS[0]}"
