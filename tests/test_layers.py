"""The layers of csrc/ include only downward (README, "Layout"): kernels and transport know
nothing of collectives or torch, algorithms know no UCX, and only c10d/ (and the
bindings above it) includes torch's distributed headers. Read from the sources; nothing
is built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)

# Project headers ("folder/file.h") each layer may include.
ALLOWED = {
    "common": ("common/",),
    "kernels": ("common/", "kernels/"),
    "transport": ("common/", "transport/"),
    # The abstract transport, the tag layout and the host shared-memory window: no UCX.
    "algorithms": ("common/", "kernels/", "algorithms/", "transport/transport.h",
                   "transport/tag.h", "transport/peer_memory/host_window.h"),
    # The strategies' cores: arithmetic on layouts and schedules, no torch, no transport.
    "parallel": ("common/", "parallel/"),
}
TORCH = ("torch/", "ATen/", "c10/", "pybind11/")


def _includes(layer: str) -> list[tuple[str, str, str]]:
    """(file, kind, header) for every include of the layer's sources."""
    out = []
    for path in sorted((CSRC / layer).rglob("*")):
        if path.suffix in (".h", ".hpp", ".cpp", ".cu", ".cuh"):
            text = path.read_text()
            out += [(str(path.relative_to(CSRC)), kind, header)
                    for kind, header in INCLUDE.findall(text)]
    return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_includes_only_downward(layer: str) -> None:
    found = _includes(layer)
    assert found, f"no sources found under csrc/{layer}"
    bad = []
    for path, kind, header in found:
        if kind == '"' and not header.startswith(ALLOWED[layer]):
            bad.append(f"{path}: {header}")
        if kind == "<" and header.startswith(TORCH):
            bad.append(f"{path}: <{header}> (torch belongs to c10d/)")
        if kind == "<" and header.startswith("ucp/") and not path.startswith("transport/ucx/"):
            bad.append(f"{path}: <{header}> (UCX belongs to transport/ucx/)")
    assert not bad, f"csrc/{layer} includes upward or sideways:\n" + "\n".join(bad)


def test_only_c10d_includes_torch_distributed() -> None:
    bad = []
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".h", ".hpp", ".cpp", ".cu", ".cuh"):
            continue
        rel = str(path.relative_to(CSRC))
        if rel.startswith("c10d/") or rel.startswith("bindings"):
            continue
        for _, header in INCLUDE.findall(path.read_text()):
            if header.startswith("torch/csrc/distributed"):
                bad.append(f"{rel}: {header}")
    assert not bad, "\n".join(bad)
