#!/usr/bin/env bash
# Build and check tdx on a GPU host that has torch but no UCX headers and no internet.
# Expects the libucx-cu13 wheel for this Python in .whl/ (see README, "GPU host").
# Writes logs and results under $OUT (default: ./device-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
PY=${PY:-python3}

{
  nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"

$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

start=$(date +%s)
$PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
if [ $rc -ne 0 ]; then tail -80 "$OUT/build.log"; exit $rc; fi

$PY -c "import torchdist_ext; print('ucx', torchdist_ext.ucx_version())" 2>&1 | tee -a "$OUT/env.txt"

# Tests: CUDA-marked ones plus the CPU suite (fast on 16 cores).
timeout 420 $PY -m pytest -q -x ${TDX_PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -40
