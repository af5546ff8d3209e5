#!/usr/bin/env bash
# Build and check tdx on a GPU host that has torch but no UCX headers and no internet.
# Expects the libucx-cu13 wheel for this Python in .whl/ (see README, "GPU host check").
# Writes its logs and results, packed, to $OUT/results.tgz (default: ./device-out). Stages:
#   TDX_STAGES="build smoke failures destroyprobe cuda cpubench threads membw calibrate
#               autocheck bench sparse compressed zero ps cpu"
#     (default: all, in that order; correctness first, so a short session still gets
#     it). Stages run in the order given; build, when named, runs first.
#     failures: the CUDA failure-path tests; destroyprobe: scripts/destroy_probe.py, a
#     group destroyed while its GPU-flag work waits on a peer (a slow one, then a killed
#     one), each rank's steps logged and a hung rank's stacks taken; cuda: the other
#     cuda tests; cpubench: CPU
#     all_reduce against gloo at 2 and 4 ranks (4 KiB to 128 MiB), then every op at 4;
#     threads: the CPU all_reduce with TDX_SHM_THREADS 1, 2, 4 (and 8 at 2 ranks) at
#     2 and 4 ranks, auto and cma pinned, gloo beside the one-thread run;
#     membw: the host's memory-copy bandwidth by threads, and the helper pool's cost
#     per pass (scripts/pass_pool_probe.py); calibrate: the cost model
#     fitted to this host at 2 ranks (all_reduce, with the thread exponent at the
#     default thread count), into $OUT/calibration.json, which the later bench stages
#     then load (the cpu stage's tests keep to the defaults); autocheck: tdx's automatic choice against every fixed CPU all_reduce
#     algorithm at 2 and 4 ranks; sparse: `bench sparse` (all_reduce of sparse embedding
#     gradients, tdx and gloo, checked) on the CPU at 4 ranks and on CUDA at 2;
#     compressed: the compression codecs alone (scripts/codec_probe.py), then `bench
#     compressed` on the CPU at 4 ranks (tdx and gloo) and on CUDA at 2 (tdx).
#   zero: `bench zero` (a training step under DDP and ZeRO-1, 2 and 3) on the CPU at 4 ranks
#     (tdx and gloo) and on CUDA at 2 (tdx), there also with bfloat16 parameters.
#   ps: `bench ps` (a worker's step with a parameter server, sync and async, against DDP)
#     on the CPU at 6 ranks, 2 of them servers (tdx and gloo), and on CUDA at 3, 1 server
#     (tdx).
# Other settings:
#   TDX_DEADLINE=S          stop starting stages, and cut the running one short, S seconds
#                           after the script starts (default 3600)
#   TDX_KEEP_CXX=1          keep $CXX/$CC instead of the system compiler (see below)
#   TDX_BENCH_ARGS="..."    the GPU bench's size and iteration flags
#                           (default: -b 4K -e 256M -f 4 -n 20 -w 5)
#   TDX_CUDA_TESTS=PATHS    what the cuda stage passes to pytest (default: tests)
#   TDX_CUDA_TIMEOUT=S      the cuda stage's time limit in seconds (default: 300)
#   TDX_FAILURES_K=EXPR     pytest -k expression for the failures stage (default: all)
#   PY, MAX_JOBS            the Python to use (python3), build jobs (16)
set -uo pipefail
cd "$(dirname "$0")/.."
# Logs go to a folder of their own; $OUT gets them packed (few files come back from a
# lent machine) and after every stage, so a run cut short still returns what it did.
DEST=${OUT:-$PWD/device-out}
OUT=$(mktemp -d /tmp/tdx-device-XXXX)
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
PY=${PY:-python3}
KNOWN="build smoke failures destroyprobe cuda cpubench threads membw calibrate autocheck bench sparse compressed zero ps cpu"
STAGES=${TDX_STAGES:-$KNOWN}
for stage in $STAGES; do  # a misspelt stage fails now, not after the others' time
  [[ " $KNOWN " == *" $stage "* ]] || { echo "unknown stage: $stage (known: $KNOWN)"; exit 2; }
done
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s)
DEADLINE=${TDX_DEADLINE:-3600}
# A stage's time limit: its own cap, or what is left before the deadline, less a margin
# for packing the results.
limit() { local left=$(( DEADLINE - ($(date +%s) - T0) - 10 )); echo $(( left < $1 ? left : $1 )); }
pack() { tar czf "$DEST/results.tgz" -C "$OUT" . 2>/dev/null; }
trap pack EXIT

# The extension's inline libstdc++ code must match the libstdc++ the process loads (the
# system's, through Python): a newer side-installed GCC builds code that crashes in
# iostreams there. Prefer the system compiler unless CXX is given.
if [ -z "${TDX_KEEP_CXX:-}" ] && [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi

{
  date -u; nvidia-smi -L
  echo "CC=${CC:-} CXX=${CXX:-}"; ${CXX:-g++} --version | head -1
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"

$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

if has build; then
  start=$(date +%s)
  $PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1
  rc=$?
  echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
  if [ $rc -ne 0 ]; then grep -B2 -A12 -m5 "error" "$OUT/build.log" | tail -80; exit $rc; fi
fi

$PY - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import torch, torchdist_ext
from torchdist_ext import _C
print("ucx", torchdist_ext.ucx_version(), "cuda kernels", _C.cuda_enabled())
# Device-to-device copy bandwidth, counting bytes read and written (the busbw yardstick).
x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record(); [y.copy_(x) for _ in range(20)]; e.record(); torch.cuda.synchronize()
print(f"d2d copy {2 * x.numel() * 20 / (s.elapsed_time(e) * 1e-3) / 1e9:.0f} GB/s (read+write)")
print("stream memops", _C.stream_memops_available())
EOF

stage_smoke() {
  # A crash is re-run under cuda-gdb (it debugs host code too) for a native backtrace.
  timeout 60 $PY -X faulthandler scripts/device_smoke.py 2>&1 | tee "$OUT/smoke.log"
  if ! grep -q "cuda ok" "$OUT/smoke.log"; then
    timeout 120 cuda-gdb -batch -ex run -ex bt -ex "info threads" \
      --args $PY scripts/device_smoke.py 2>&1 | tail -60 | tee -a "$OUT/smoke.log"
    exit 1
  fi
}

stage_failures() {
  [ "$(limit 200)" -gt 30 ] || return 0
  timeout "$(limit 200)" $PY -m pytest -q -s -m cuda --durations=10 tests/test_cuda_failures.py \
    ${TDX_FAILURES_K:+-k "$TDX_FAILURES_K"} 2>&1 | tee "$OUT/pytest_cuda_failures.log" | tail -40
  pack
}

stage_destroyprobe() {
  # 40 s each: the stall is about 10 s, the group timeout 6 s.
  local how
  for how in slow kill; do
    [ "$(limit 120)" -gt 90 ] || break
    timeout "$(limit 120)" $PY scripts/destroy_probe.py $([ $how = kill ] && echo --kill) \
      --limit 40 --out "$OUT/destroy_probe_$how" 2>&1 | tee "$OUT/destroy_probe_$how.txt"
    pack
  done
}

stage_cuda() {
  [ "$(limit ${TDX_CUDA_TIMEOUT:-300})" -gt 30 ] || return 0
  timeout "$(limit ${TDX_CUDA_TIMEOUT:-300})" $PY -m pytest -q -m cuda --durations=10 \
    --deselect tests/test_cuda_failures.py ${TDX_CUDA_TESTS:-tests} 2>&1 \
    | tee "$OUT/pytest_cuda.log" | tail -40
  pack
}

stage_cpubench() {
  for w in 2 4; do
    [ "$(limit 90)" -gt 30 ] || break
    timeout "$(limit 90)" $PY -m torchdist_ext.bench --device cpu --world $w --backends tdx,gloo \
      -b 4K -e 128M -f 2 -n 10 -w 3 --no-progress --json "$OUT/bench_cpu_w$w.json" 2>&1 \
      | tee "$OUT/bench_cpu_w$w.txt" | tail -45
    pack
  done
  if [ "$(limit 120)" -gt 30 ]; then
    timeout "$(limit 120)" $PY -m torchdist_ext.bench --device cpu --world 4 --op all \
      --backends tdx,gloo -b 4K -e 64M -f 16 -n 5 -w 2 --no-progress \
      --json "$OUT/bench_cpu_all_w4.json" > "$OUT/bench_cpu_all_w4.txt" 2>&1
    pack
  fi
}

stage_threads() {
  # gloo runs beside the one-thread row only: the thread count is tdx's alone.
  local w t backends
  for w in 2 4; do
    for t in 1 2 4 $([ $w = 2 ] && echo 8); do
      [ "$(limit 60)" -gt 30 ] || break 2
      backends=tdx,tdx:cma; [ $t = 1 ] && backends=tdx,tdx:cma,gloo
      TDX_SHM_THREADS=$t timeout "$(limit 60)" $PY -m torchdist_ext.bench --device cpu \
        --world $w --backends $backends -b 1M -e 128M -f 2 -n 10 -w 3 --no-progress \
        --json "$OUT/threads_w${w}_t$t.json" > "$OUT/threads_w${w}_t$t.txt" 2>&1
      grep -E "^ +(tdx|gloo) " "$OUT/threads_w${w}_t$t.txt" | sed "s/^/w$w t$t /"
    done
    pack
  done
}

stage_membw() {
  timeout "$(limit 60)" $PY scripts/membw_probe.py 2>&1 | tee "$OUT/membw.txt"
  timeout "$(limit 60)" $PY scripts/pass_pool_probe.py 2>&1 | tee "$OUT/pass_pool.txt"
  pack
}

stage_calibrate() {
  [ "$(limit 150)" -gt 60 ] || return 0
  timeout "$(limit 150)" $PY -m torchdist_ext.bench calibrate --world 2 --ops all_reduce \
    --sizes 4K,16K,64K,256K,1M,4M,16M,64M -n 10 -w 3 --no-progress \
    --out "$OUT/calibration.json" --json "$OUT/calibration_fit.json" \
    > "$OUT/calibration.txt" 2>&1
  grep -E "^# " "$OUT/calibration.txt" | head -30
  # The stages after this one price with it, as a host whose file it were.
  [ -s "$OUT/calibration.json" ] && export TDX_CALIBRATION="$OUT/calibration.json"
  pack
}

stage_autocheck() {
  for w in 2 4; do
    [ "$(limit 80)" -gt 30 ] || break
    timeout "$(limit 80)" $PY -m torchdist_ext.bench --device cpu --world $w \
      --backends tdx,tdx:all -b 4K -e 64M -f 4 -n 10 -w 3 --rounds 3 --check-auto report \
      --no-progress --json "$OUT/autocheck_w$w.json" > "$OUT/autocheck_w$w.txt" 2>&1
    tail -25 "$OUT/autocheck_w$w.txt"
    pack
  done
}

stage_bench() {
  for w in 2 4; do
    [ "$(limit 150)" -gt 30 ] || break
    timeout "$(limit 150)" $PY -m torchdist_ext.bench --device cuda --world $w --backends tdx,gloo \
      ${TDX_BENCH_ARGS:--b 4K -e 256M -f 4 -n 20 -w 5} --json "$OUT/bench_cuda_w$w.json" 2>&1 \
      | tee "$OUT/bench_cuda_w$w.txt" | tail -30
  done
}

stage_sparse() {
  local dev w
  for dev in cpu cuda; do
    w=$([ $dev = cpu ] && echo 4 || echo 2)
    [ "$(limit 90)" -gt 30 ] || break
    timeout "$(limit 90)" $PY -m torchdist_ext.bench sparse --device $dev --world $w \
      --rows 1M --dim 64 --lookups 1K,8K,64K --json "$OUT/sparse_${dev}_w$w.json" 2>&1 \
      | tee "$OUT/sparse_${dev}_w$w.txt" | tail -12
    pack
  done
}

stage_compressed() {
  local dev w backends
  [ "$(limit 60)" -gt 20 ] || return 0
  OMP_NUM_THREADS=1 timeout "$(limit 60)" $PY scripts/codec_probe.py 2>&1 \
    | tee "$OUT/codec_probe.txt"
  for dev in cpu cuda; do
    w=$([ $dev = cpu ] && echo 4 || echo 2)
    backends=$([ $dev = cpu ] && echo tdx,gloo || echo tdx)
    [ "$(limit 120)" -gt 30 ] || break
    OMP_NUM_THREADS=1 timeout "$(limit 120)" $PY -m torchdist_ext.bench compressed \
      --device $dev --world $w --backends $backends --sizes 1M,16M,64M \
      --json "$OUT/compressed_${dev}_w$w.json" 2>&1 \
      | tee "$OUT/compressed_${dev}_w$w.txt" | tail -16
    pack
  done
}

stage_zero() {
  local dev w backends dtype
  for dev in cpu cuda cuda-bf16; do
    # cuda-bf16: ZeRO with bfloat16 parameters over float32 shards, on the GPU.
    dtype=$([ $dev = cuda-bf16 ] && echo bfloat16 || echo float32)
    w=$([ $dev = cpu ] && echo 4 || echo 2)
    backends=$([ $dev = cpu ] && echo tdx,gloo || echo tdx)
    [ "$(limit 120)" -gt 30 ] || break
    OMP_NUM_THREADS=1 timeout "$(limit 120)" $PY -m torchdist_ext.bench zero \
      --device "${dev%-bf16}" --world $w --backends $backends --params 1M,16M \
      --param-dtype $dtype --json "$OUT/zero_${dev}_w$w.json" 2>&1 \
      | tee "$OUT/zero_${dev}_w$w.txt" | tail -10
    pack
  done
}

stage_ps() {
  local dev w servers backends
  for dev in cpu cuda; do
    w=$([ $dev = cpu ] && echo 6 || echo 3)
    servers=$([ $dev = cpu ] && echo 2 || echo 1)
    backends=$([ $dev = cpu ] && echo tdx,gloo || echo tdx)
    [ "$(limit 120)" -gt 30 ] || break
    OMP_NUM_THREADS=1 timeout "$(limit 120)" $PY -m torchdist_ext.bench ps \
      --device $dev --world $w --servers $servers --backends $backends --params 1M,16M \
      --json "$OUT/ps_${dev}_w$w.json" 2>&1 \
      | tee "$OUT/ps_${dev}_w$w.txt" | tail -10
    pack
  done
}

stage_cpu() {
  [ "$(limit 300)" -gt 30 ] || return 0
  timeout "$(limit 300)" $PY -m pytest -q -m "not cuda" tests 2>&1 | tee "$OUT/pytest_cpu.log" | tail -15
}

for stage in $STAGES; do
  [ "$stage" = build ] && continue
  [ "$(limit 60)" -gt 20 ] || { echo "deadline: $stage not started"; break; }
  "stage_$stage"
done
