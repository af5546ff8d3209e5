"""torchdist_ext: the ``tdx`` torch.distributed backend over UCX.

Importing this package registers the backend for CPU and CUDA tensors::

    import torch.distributed as dist
    import torchdist_ext
    dist.init_process_group("tdx")
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist  # registers c10d's pybind types before our module loads

# UCX reads these when its libraries load. Its SIGSEGV/SIGBUS handlers fight Python's and
# torch's crash reporting, and its memory-type cache can misjudge memory recycled by
# torch's caching allocator; the user's own settings win.
os.environ.setdefault("UCX_ERROR_SIGNALS", "")
os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")

try:  # UCX from the libucx-cu13 wheel; a system UCX (TDX_UCX_HOME) is found by rpath.
    import libucx

    libucx.load_library()
except ImportError:  # pragma: no cover - depends on how UCX was provided
    pass

from . import _C  # noqa: E402

__all__ = ["BACKEND_NAME", "ucx_version", "env_knobs"]
__version__ = "0.1.0"

BACKEND_NAME = "tdx"


def _create_backend(dist_opts: Any, pg_opts: Any) -> Any:
    """Factory torch.distributed calls for every group that uses ``tdx``."""
    timeout = dist_opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    return _C._create_backend(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        timeout,
        str(dist_opts.group_id),
        [int(r) for r in dist_opts.global_ranks_in_group],
    )


def ucx_version() -> str:
    """Version of the UCX library the backend runs on."""
    return _C.ucx_version()


def env_knobs() -> list[tuple[str, str, str]]:
    """Every ``TDX_*`` environment variable as (name, default, meaning)."""
    return list(_C.env_knobs())


if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )
