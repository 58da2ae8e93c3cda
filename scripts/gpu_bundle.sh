#!/usr/bin/env bash
# `make gpu-bundle`: what a lent GPU machine lacks, gathered here, where pip reaches PyPI, into two
# git-ignored folders that travel with the working tree (the device tool's `carry`):
#   .whl/     wheels its image does not hold: hydra-core, omegaconf, antlr4 (dtrain's config), torchao
#             (train.float8) and liger-kernel (train.loss_kernel=fused), for Python 3.12 on x86-64
#   .device/  the GPT-2 vocabulary and the default dataset prepared (cache/, data/), and
#             tinyshakespeare's text (the tests' corpus, the benchmark's mixture)
# The machine runs Python 3.12 with torch 2.11+CUDA, pytest, tiktoken, rich, xxhash and tokenizers,
# and reaches no network. scripts/gpu_session.sh is what runs there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TINYSHAKESPEARE=${TINYSHAKESPEARE:-../shared/data/tinyshakespeare/input.txt}
[ -x "$PY" ] || { echo "error: $PY is missing; run make setup first (or PY=/path/to/python make gpu-bundle)" >&2; exit 2; }
# The versions this checkout's environment is tested with; liger-kernel (CUDA only, so in no test
# extra) at the version issue 50 names.
pinned() { "$PY" -c "import importlib.metadata as m, sys; print(f'{sys.argv[1]}=={m.version(sys.argv[1])}')" "$1"; }
HYDRA=$(pinned hydra-core) OMEGACONF=$(pinned omegaconf) ANTLR=$(pinned antlr4-python3-runtime)
TORCHAO=torchao==0.18.0 LIGER=liger-kernel==0.8.5
[ -f "$TINYSHAKESPEARE" ] || { echo "error: no tinyshakespeare text at $TINYSHAKESPEARE; set TINYSHAKESPEARE=FILE" >&2; exit 2; }

rm -rf .whl .device
mkdir -p .whl .device/cache .device/data .device/tinyshakespeare
platforms=()
for n in 2_28 2_27 2_17; do platforms+=(--platform "manylinux_${n}_x86_64"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d .whl "$HYDRA" "$OMEGACONF" "$TORCHAO" "$LIGER"
"$PY" -m pip wheel -q --no-deps -w .whl "$ANTLR"  # published as source only

cp "$TINYSHAKESPEARE" .device/tinyshakespeare/input.txt
# dtrain's own preparation, into the folders the session points DTRAIN_CACHE_DIR and DTRAIN_DATA_DIR at
DTRAIN_CACHE_DIR=.device/cache DTRAIN_DATA_DIR=.device/data "$PY" -m trainer prepare data=shakespeare >/dev/null
du -sh .whl .device
ls .whl
