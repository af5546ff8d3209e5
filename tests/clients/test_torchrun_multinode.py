"""The multi-node shape, on one machine: two torchrun "nodes" (--nnodes 2
--nproc-per-node 2) meet through the c10d rendezvous on a free local port and run
examples/ddp.py on tdx for two epochs. Both launchers must exit 0 and rank 0 must print
a falling loss for each epoch.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp.py"
TIMEOUT = 150  # seconds per launcher


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_run_ddp_example() -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    run_id = uuid.uuid4().hex[:12]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
           "--max-restarts", "0",
           str(EXAMPLE), "--backend", "tdx", "--epochs", "2", "--samples", "4000"]
    # Each launcher leads its own session, so a hung one is stopped with its workers.
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=EXAMPLE.parents[1], start_new_session=True)
             for _ in range(2)]
    outputs = ["", ""]
    try:
        for i, node in enumerate(nodes):
            outputs[i] = node.communicate(timeout=TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        pass
    finally:
        for i, node in enumerate(nodes):
            if node.poll() is None:
                outputs[i] = f"[killed after {TIMEOUT} s]\n"
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    os.killpg(node.pid, sig)
                    try:
                        node.wait(timeout=15)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            if not outputs[i].strip() or outputs[i].startswith("[killed"):
                outputs[i] += node.communicate()[0]
    report = "\n".join(f"--- node {i} (exit {n.returncode}) ---\n{o[-4000:]}"
                       for i, (n, o) in enumerate(zip(nodes, outputs)))
    assert [n.returncode for n in nodes] == [0, 0], report
    text = "".join(outputs)
    assert "DDP on 4 ranks, backend tdx" in text, report
    losses = [float(v) for v in re.findall(r"epoch\s+\d+\s+loss (\d+\.\d+)", text)]
    assert len(losses) == 2, report  # printed once per epoch, by global rank 0 only
    assert losses[1] < losses[0], report
