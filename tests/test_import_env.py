"""What `import torchdist_ext` sets in the environment for UCX, and what it leaves alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SEG = ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE")


def _after_import(env: dict[str, str]) -> dict[str, str | None]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    code = ("import json, os, torchdist_ext; "
            f"print(json.dumps({{k: os.environ.get(k) for k in {list(SEG)!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("env, want", [
    ({}, {"UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "1m"}),
    # a user's own setting of either keeps UCX's default for the other
    ({"UCX_TCP_RX_SEG_SIZE": "64k"}, {"UCX_TCP_TX_SEG_SIZE": None, "UCX_TCP_RX_SEG_SIZE": "64k"}),
    # no TCP transport: nothing for it (UCX would warn about unused settings)
    ({"UCX_TLS": "^tcp"}, {"UCX_TCP_TX_SEG_SIZE": None, "UCX_TCP_RX_SEG_SIZE": None}),
    ({"UCX_TLS": "sm,self"}, {"UCX_TCP_TX_SEG_SIZE": None, "UCX_TCP_RX_SEG_SIZE": None}),
    ({"UCX_TLS": "tcp,self"}, {"UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "1m"}),
])
def test_tcp_segment_defaults(env: dict[str, str], want: dict[str, str | None]) -> None:
    assert _after_import(env) == want
