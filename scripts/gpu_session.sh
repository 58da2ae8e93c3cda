#!/usr/bin/env bash
# What a session runs on a lent GPU machine through the device tool, after `make gpu-bundle` here. A
# lease is 15 minutes with the machine's start and the idle time between calls: about 12 for commands.
#
#   run(command="bash scripts/gpu_session.sh tests bench:memory,throughput,choices,watch:380",
#       carry=[".whl", ".device"], timeout_s=540)                                  # about 8 minutes
#   run(command="bash scripts/gpu_session.sh bench:kernels:200", carry=[...])      # with what is left
#
# Steps, in the order given; everything printed also goes to $OUT/session.log, and each bench step's
# rows to $OUT/bench_<sections>.json (what comes back: at most 8 files, named in [A-Za-z0-9._-]):
#   tests                       the tests marked `cuda` (they skip on a machine without a GPU)
#   bench[:SECTIONS[:BUDGET]]   scripts/bench_gpu.py, those sections (comma list; default all) within
#                               BUDGET seconds (default 400): rows as they land, then the table
#   train                       `dtrain train` as a user types it, on the GPU, 30 steps of gpt2_124m
# A step that fails is reported and the next one still runs; the exit status is the first failure's.
# CPU=1 runs the same steps on a CPU (bench_gpu.py --device cpu --tiny): a rehearsal of the script.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-session}
[ $# -gt 0 ] || set -- tests bench
for step in "$@"; do
    case $step in
        tests|train|bench|bench:*) ;;
        *) echo "error: unknown step $step; the steps are tests, bench[:SECTIONS[:BUDGET_S]] and train" >&2; exit 2 ;;
    esac
done
for want in .whl .device/cache/gpt2.tiktoken .device/data/shakespeare/manifest.json .device/tinyshakespeare/input.txt; do
    [ -e "$want" ] || { echo "error: $want is missing: run make gpu-bundle here, then carry .whl and .device" >&2; exit 2; }
done
mkdir -p "$OUT"

session() {
    # The image's Python holds torch; dtrain's config libraries and the kernel extras come as wheels.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dtrain-site \
        .whl/*.whl || return
    export PYTHONPATH=/tmp/dtrain-site:$PWD PYTHONUNBUFFERED=1
    export DTRAIN_CACHE_DIR=$PWD/.device/cache DTRAIN_DATA_DIR=$PWD/.device/data
    # The tests' corpus and the benchmark's mixture read tinyshakespeare where this machine's checkout
    # finds it: ../shared/data beside the repository.
    mkdir -p ../shared/data/tinyshakespeare && cp -n .device/tinyshakespeare/input.txt ../shared/data/tinyshakespeare/

    local device=cuda tiny=()
    if [ "${CPU:-0}" = 1 ]; then device=cpu tiny=(--tiny); else
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    fi
    python3 -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda)"

    local status=0 step started rc sections budget name
    for step in "$@"; do
        started=$SECONDS
        case $step in
            tests)
                mapfile -t files < <(grep -rl "pytest.mark.cuda" tests --include='test_*.py' | sort)
                python3 -m pytest -m cuda -p no:cacheprovider -q "${files[@]}"
                rc=$? ;;
            bench|bench:*)
                IFS=: read -r _ sections budget <<<"$step"
                name=${sections:-all}
                local args=(--device "$device" "${tiny[@]}" --budget-s "${budget:-400}" --json "$OUT/bench_${name//,/-}.json")
                [ -n "$sections" ] && args+=(--sections "$sections")
                python3 scripts/bench_gpu.py "${args[@]}"
                rc=$? ;;
            train)
                local model=gpt2_124m run_dir
                [ "$device" = cpu ] && model=tiny
                run_dir=$(mktemp -d)
                python3 -m trainer train model=$model train.device=$device train.max_steps=30 train.log_interval=10 \
                    "hydra.run.dir=$run_dir/run" | cat  # stdout a pipe, as in CI and Slurm logs
                rc=${PIPESTATUS[0]} ;;
        esac
        echo "gpu-session: $step took $((SECONDS - started)) s, exit $rc"
        [ "$rc" = 0 ] || [ "$status" != 0 ] || status=$rc
    done
    return "$status"
}

session "$@" 2>&1 | tee -a "$OUT/session.log"
exit "${PIPESTATUS[0]}"
