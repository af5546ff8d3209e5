"""Where each rank spends its time when a group is destroyed while its device work waits
on a peer's GPU-side flags (docs/RELIABILITY.md, "Known gaps": the withdrawn destroy-time
release went silent on both ranks, cause unknown).

Two ranks, ``TDX_CUDA_PEER_SYNC=gpu``. Rank 1 stalls its stream behind a long kernel and
queues an all_reduce on a subgroup, whose kernel then waits behind the stall; rank 0
queues the same all_reduce, whose kernel waits for rank 1's flag. Both destroy the
subgroup. Then, with ``--kill``, rank 1 kills itself, so its flag never comes; without,
it only stays slow, and its kernel runs when the stall ends. Rank 0 then synchronizes its
device and runs one more kernel.

Each rank writes every step, timestamped from its start, to ``OUT/rank<r>.log`` as it
happens. A rank still alive at ``--limit`` seconds gets its Python threads' stacks
(faulthandler, on SIGUSR1) and its native threads' stacks (gdb or cuda-gdb attached)
written to ``OUT/rank<r>.stacks``, and is killed. The last lines say how each rank
ended. Known today: with ``--kill`` rank 0's synchronize never returns (nothing releases
its stream once the group is gone); the question is what else blocks, and where.

``--cpu`` runs the same steps on CPU tensors (no stall; the op completes) and
``--cpu-hang`` then makes rank 0 wait forever at the end: both check this harness, and
its stack capture, on a machine without a GPU.

    python scripts/destroy_probe.py --kill --out /tmp/probe
"""

from __future__ import annotations

import argparse
import faulthandler
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# torch.cuda._sleep cycles: about 10 s at an H100's or H200's ~2 GHz.
STALL_CYCLES = 20_000_000_000
ELEMENTS = 1 << 20


def _rank(rank: int, store_path: str, out: str, kill: bool, cpu: bool, hang: bool,
          timeout_s: float) -> None:
    begun = time.monotonic()
    log = open(os.path.join(out, f"rank{rank}.log"), "w", buffering=1)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)

    def step(text: str) -> None:
        log.write(f"{time.monotonic() - begun:8.3f}s {text}\n")
        log.flush()

    import datetime

    import torch
    import torch.distributed as dist

    import torchdist_ext  # noqa: F401 - registers tdx

    step(f"pid {os.getpid()}, torch {torch.__version__}")
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("tdx", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    dev = torch.device("cpu")
    if not cpu:
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(ELEMENTS, device=dev), group=group)  # the peer path set up
    if not cpu:
        torch.cuda.synchronize(dev)
    step("group set up")
    t = torch.ones(ELEMENTS, device=dev)
    if rank == 1 and not cpu:
        torch.cuda._sleep(STALL_CYCLES)
        step("stream stalled")
    dist.all_reduce(t, group=group, async_op=True)
    step("all_reduce queued")
    time.sleep(0.3 if rank == 1 else 0.5)
    step("destroying the group")
    dist.destroy_process_group(group)
    step("group destroyed")
    if rank == 1:
        if kill:
            time.sleep(0.5)
            step("killing itself")
            os.kill(os.getpid(), signal.SIGKILL)
        if not cpu:
            torch.cuda.synchronize(dev)
            step(f"synchronized, all_reduce gave {t[0].item()}")
    else:
        if not cpu:
            step("synchronizing the device")
            torch.cuda.synchronize(dev)
            step(f"synchronized, all_reduce gave {t[0].item()}")
            x = torch.arange(5, device=dev, dtype=torch.float32) * 2
            step(f"one more kernel: {x.sum().item()}")
        if hang:
            step("waiting forever (--cpu-hang)")
            while True:
                time.sleep(1)
    step("destroying the world")
    dist.destroy_process_group()
    step("done")


def _stacks(pid: int, path: Path) -> None:
    """The Python stacks (the rank's faulthandler writes them to its log) and the native
    stacks of every thread of ``pid``, into ``path``."""
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return
    time.sleep(0.5)
    debugger = shutil.which("gdb") or shutil.which("cuda-gdb")
    if debugger is None:
        path.write_text("no gdb or cuda-gdb here: native stacks not taken\n")
        return
    try:
        done = subprocess.run([debugger, "-batch", "-p", str(pid), "-ex",
                               "thread apply all bt 30"], capture_output=True, text=True,
                              timeout=60)
        path.write_text(done.stdout + done.stderr)
    except subprocess.TimeoutExpired:
        path.write_text(f"{debugger} did not finish within 60 s\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kill", action="store_true",
                   help="rank 1 kills itself after its destroy (its flag never comes)")
    p.add_argument("--cpu", action="store_true", help="CPU tensors: checks the harness")
    p.add_argument("--cpu-hang", action="store_true",
                   help="with --cpu: rank 0 waits forever at the end (checks the stacks)")
    p.add_argument("--limit", type=float, default=40.0,
                   help="seconds before live ranks get their stacks taken and are killed")
    p.add_argument("--timeout", type=float, default=6.0, help="the groups' timeout, s")
    p.add_argument("--out", default=None, help="folder for the logs (default: a new one)")
    a = p.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="tdx-destroy-probe-"))
    out.mkdir(parents=True, exist_ok=True)
    if not a.cpu:
        os.environ["TDX_CUDA_PEER_SYNC"] = "gpu"
    store = os.path.join(tempfile.mkdtemp(prefix="tdx-probe-store-"), "store")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, store, str(out), a.kill, a.cpu,
                                             a.cpu and a.cpu_hang, a.timeout))
             for r in range(2)]
    for proc in procs:
        proc.start()
    end = time.monotonic() + a.limit
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    for r, proc in enumerate(procs):
        if proc.is_alive():
            _stacks(proc.pid, out / f"rank{r}.stacks")
            proc.kill()
            proc.join()
            how = f"still running at {a.limit:g} s: stacks in rank{r}.stacks and rank{r}.log"
        elif proc.exitcode == -signal.SIGKILL and r == 1 and a.kill:
            how = "killed itself, as asked"
        else:
            how = f"exited with code {proc.exitcode}"
        log = (out / f"rank{r}.log").read_text() if (out / f"rank{r}.log").exists() else ""
        steps = [line for line in log.splitlines() if re.match(r"\s*\d+\.\d{3}s ", line)]
        last = steps[-1].strip() if steps else "(no step logged)"
        print(f"rank {r}: {how}; last step: {last}")
    print(f"logs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
