#!/usr/bin/env bash
# The GPU check of issue 16, in one run on a lent GPU machine (an H200 with python3, torch CUDA, triton and
# transformers installed, no network, no flash-attn; the working tree copied there; $OUT comes back):
#   1. the project importable without network: wheels carried in .whl/ (made here by --fetch-wheels) installed
#      into /tmp/site, the working tree on PYTHONPATH; what is still missing is listed;
#   2. nvidia-smi and the versions (env.txt);
#   3. the cuda-marked tests (every tests/ file that marks tests cuda), then the Triton kernel tests natively on
#      the GPU (TRITON_INTERPRET unset);
#   4. `splitserve bench throughput --device cuda` on the qwen2.5-0.5b checkpoint (Qwen2.5-0.5B's shape, random
#      seeded weights, built there into /tmp in about a minute): splitserve against transformers generate and
#      generate_batch, MFU over the bf16 matmul peak, single-request ITL against the weight-read bound.
# Logs, the JUnit XML and the benchmark's JSON and PNG go to $OUT (at most 8 files come back). Every step has its
# own timeout, about 8 minutes in all, so a rerun fits in the 15 minutes of device time. A step that fails or
# times out is reported and the next one still runs; the exit status is the first failure's.
#
# Here, before the run (once; pip reaches the package index from this machine only):
#   scripts/gpu_check.sh --fetch-wheels      # .whl/: the versions of this checkout's .venv, for Python 3.12
# then call the device tool with carry [".whl"] and the command `bash scripts/gpu_check.sh`.
# Environment: PYTHON (python3), NUM_PROMPTS (256), OUT (./gpu-check-out when unset), WHEEL_DIR (.whl).
set -uo pipefail
cd "$(dirname "$0")/.."

# What the device lacks or has too old, pinned to this checkout's .venv: the gRPC and OpenTelemetry packages
# (its image has grpcio and protobuf, maybe older than the stubs' protobuf gencode), and transformers (the image's
# 5.17 predates the generate_batch API the benchmark uses).
WHEELS="protobuf grpcio grpcio-health-checking grpcio-reflection grpcio-status googleapis-common-protos
opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
opentelemetry-exporter-otlp-common opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
opentelemetry-instrumentation opentelemetry-instrumentation-grpc transformers"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    venv_python=${VENV_PYTHON:-.venv/bin/python}
    freeze=$("$venv_python" -m pip freeze)
    pins=()
    for name in $WHEELS; do
        pin=$(grep -i -E "^${name//-/[-_]}==" <<<"$freeze") || { echo "not in $venv_python's environment: $name"; exit 1; }
        pins+=("$pin")
    done
    mkdir -p .whl
    platforms=()
    for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    "$venv_python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}" || exit 1
    du -sh .whl
    exit 0
fi

PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
NUM_PROMPTS=${NUM_PROMPTS:-256}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPLITSERVE_CACHE_DIR=/tmp/splitserve-cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
status=0
step() {  # step NAME TIMEOUT_S LOG COMMAND...: run, log, report
    local name=$1 limit=$2 log=$3
    shift 3
    local start=$SECONDS
    echo "=== $name (timeout ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    tail -n 25 "$log"
    echo "=== $name: exit $rc after $((SECONDS - start)) s$([[ $rc == 124 || $rc == 137 ]] && echo ' (timed out)')"
    [[ $rc != 0 && $status == 0 ]] && status=$rc
    return 0
}

# 1. the project, importable without network
WHEEL_DIR=${WHEEL_DIR:-.whl}
if compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEEL_DIR"/*.whl ||
        echo "installing the carried wheels failed"
    export PYTHONPATH=/tmp/site:$PWD
else
    echo "no $WHEEL_DIR/ carried: the image's own packages only (scripts/gpu_check.sh --fetch-wheels makes them)"
    export PYTHONPATH=$PWD
fi

# 2. the machine
{
    nvidia-smi
    "$PY" - <<'EOF'
import importlib, importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for name in ("triton", "transformers", "tokenizers", "safetensors", "protobuf", "grpcio", "opentelemetry-sdk"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
for module in ("frontend_svc", "core_svc", "kernels", "benchmarks", "splitserve.entrypoints.cli", "flash_attn"):
    try:
        importlib.import_module(module)
        print("import", module, "ok")
    except Exception as exc:  # report every missing piece, not only the first
        print("import", module, "FAILED:", type(exc).__name__, exc)
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 3. the GPU tests, then the Triton kernels natively
mapfile -t cuda_tests < <(grep -l -E "pytest\.mark\.cuda|pytestmark = pytest\.mark\.cuda" tests/test_*.py)
mapfile -t triton_tests < <(ls tests/test_*triton*.py 2>/dev/null)
pytest_args=(-q -p no:cacheprovider -o addopts= -rfEs)
if ((${#cuda_tests[@]})); then
    step "pytest -m cuda ${cuda_tests[*]}" 180 "$OUT/cuda-tests.log" \
        "$PY" -m pytest "${pytest_args[@]}" -m cuda --junitxml="$OUT/cuda-tests.xml" "${cuda_tests[@]}"
fi
if ((${#triton_tests[@]})); then
    # Without the two tests that start fresh processes (one compiles the CPU kernel, one recompiles for sm_90):
    # on the GPU they prove nothing the CPU run does not, and cost a minute.
    step "Triton kernel tests on the GPU: ${triton_tests[*]}" 150 "$OUT/triton-tests.log" \
        "$PY" -m pytest "${pytest_args[@]}" -k "not never_imports_triton and not compile_for_a_gpu" \
        "${triton_tests[@]}"
else
    echo "no tests/test_*triton*.py here"
fi

# 4. the benchmark
step "bench throughput --device cuda (qwen2.5-0.5b, $NUM_PROMPTS requests)" 220 "$OUT/bench.log" \
    "$PY" -m splitserve bench throughput --device cuda --arch qwen2 --preset qwen2.5-0.5b \
    --num-prompts "$NUM_PROMPTS" --out "$OUT" --name throughput-qwen2.5-0.5b-cuda
echo "exit $status; files in $OUT:"
ls -la "$OUT"
exit $status
