#!/usr/bin/env bash
# The GPU checks, in one run on a CUDA machine (none of them is part of CI, which has no GPU):
#   1. bench/kernels.py: each Triton kernel checked against the torch reference, then timed against
#      the device's copy bandwidth and torch SDPA;
#   2. engine greedy parity on the GPU in fp32 (Triton kernels, cuBLAS): the five architectures x four
#      variants of tests/test_engine_parity.py and the sliding-window engine test, against transformers;
#   3. bench.offline_throughput on the GPU (bf16): tandem vs transformers on the same device, and
#      batch-1 decode vs the weight-bandwidth limit;
#   4. the kernel tests, compiled for the GPU (tests/triton_device.py moves their tensors there);
#   4b. the generation features on the GPU (EAGLE and the draft model — their draft chains captured as graphs too —, beam search,
#      structured outputs, sliding window, speculative decoding): their tests' greedy/exactness checks, with CUDA
#      graphs on by default;
#   5. bench.decode_profile: where a batch-1 decode step's time goes (CUDA launches, copies, syncs);
#   6. bench.speculative at batch 1 and 4 (graphs replay the verification steps and the draft chains);
#   7. `tandem up` on the GPU (P and D share it over zmq), 8 req/s: where TTFT goes (bench.ttft_breakdown);
#   8. P/D on one GPU: tests/test_disagg.py's token-identity test through zmq (the shm connector refuses GPU caches
#      by design, and NCCL does not link two ranks on one GPU: torch_dist would fall back every time).
# Each step has its own time limit and log (OUTDIR/<step>.log); a summary line per step is printed.
#
#     [STEPS="offline disagg"] bash bench/gpu_check.sh [OUTDIR]
# (tandem's dependencies importable; pytest-xdist used if present; STEPS picks steps by name)
# On a lent machine whose Python has torch, triton, transformers, grpcio and pytest but not tandem's
# other dependencies (session 22's H100 image): carry them as Python 3.12 wheels in an ignored .whl/ and
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` first — pyzmq, structlog, llguidance
# (>= 1.7), grpcio-health-checking, grpcio-reflection, grpcio and protobuf (the versions pyproject needs),
# uvicorn, httptools, fastapi, starlette, pydantic, pydantic-core, annotated-types, typing-inspection,
# opentelemetry-api, and for the structured tests jsonschema, jsonschema-specifications, referencing,
# rpds-py; for the EAGLE P/D test the openai client, httpx2, httpcore2, h11, truststore, anyio, idna, jiter,
# distro, sniffio. The serving step finds `tandem` beside the interpreter or runs `python -m tandem.cli`.
set -u
out=${1:-gpu-check-logs}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # 8 pytest workers share the CPU: transformers oracles stay small
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
# 8 workers, tests spread one by one; without xdist, pyproject's "-n auto" would be an unknown option
xdist=$($py -c "import xdist" 2>/dev/null && echo "-n 8 --dist load" || echo "-o addopts=-ra")
summary=()

step() {  # step NAME SECONDS COMMAND...   (skipped unless NAME is in $STEPS, when that is set)
    local name=$1 limit=$2 start rc
    shift 2
    [[ -z "${STEPS:-}" || " $STEPS " == *" $name "* ]] || return 0
    start=$(date +%s)
    echo "=== $name: $*"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    tail -n "${TAIL:-15}" "$out/$name.log"
    summary+=("$name rc=$rc $(( $(date +%s) - start )) s")
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
$py -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton',
triton.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"

step bench_kernels "${LIMIT_KERNELS:-90}" $py bench/kernels.py
step engine_parity "${LIMIT_PARITY:-120}" $py -m pytest -q -p no:cacheprovider $xdist tests/test_engine_parity.py \
    tests/test_sliding_window.py::test_triton_kernels_in_the_engine tests/test_cuda_graphs.py \
    tests/test_kernels_engine.py::test_engine_greedy_reference_equals_triton
step offline "${LIMIT_OFFLINE:-90}" $py -m bench.offline_throughput
step kernel_tests "${LIMIT_TESTS:-100}" $py -m pytest -q -p no:cacheprovider $xdist tests/test_kernels.py \
    tests/test_kernels_engine.py tests/test_sliding_window_kernels.py
step features "${LIMIT_FEATURES:-150}" $py -m pytest -q -p no:cacheprovider $xdist tests/test_eagle.py tests/test_draft_graphs.py \
    tests/test_beam_search.py tests/test_structured_engine.py tests/test_sliding_window.py tests/test_spec_decode.py \
    tests/test_sampling.py
step decode_profile "${LIMIT_PROFILE:-60}" $py -m bench.decode_profile
step decode_profile_eager "${LIMIT_PROFILE:-60}" $py -m bench.decode_profile --enforce-eager
step speculative "${LIMIT_SPEC:-150}" $py -m bench.speculative --batches ${SPEC_BATCHES:-1,4} --rounds ${SPEC_ROUNDS:-4} \
    --workload ${SPEC_WORKLOAD:-repeat}
step serving "${LIMIT_SERVING:-150}" $py -m bench.ttft_breakdown --rate 8
step disagg "${LIMIT_DISAGG:-150}" $py -m pytest -q -p no:cacheprovider $xdist tests/test_disagg.py \
    -k "test_disaggregated_output_identical_and_decode_reuses_cache and zmq"

printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
