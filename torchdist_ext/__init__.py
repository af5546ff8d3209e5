"""torchdist_ext: the ``tdx`` torch.distributed backend over UCX.

Importing this package registers the backend for CPU and CUDA tensors::

    import torch.distributed as dist
    import torchdist_ext
    dist.init_process_group("tdx")
"""

from __future__ import annotations

import atexit
import math
import numbers
import operator
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
# UCX's TCP settings (whether it loads at all, its segment sizes) are made by the
# transport when it starts, from where the ranks run: see TDX_UCX_TCP.

try:
    from ._build_info import UCX_HOME as _UCX_HOME
except ImportError:  # pragma: no cover - a tree not built by setup.py
    _UCX_HOME = None
# UCX from the libucx-cu13 wheel, loaded before the extension so that the extension's
# libucp.so.0 resolves to it. A build against a UCX of one's own (TDX_UCX_HOME) finds
# that one by rpath instead, which a preloaded wheel would shadow.
if not _UCX_HOME:
    try:
        import libucx

        libucx.load_library()
    except ImportError:  # pragma: no cover - depends on how UCX was provided
        pass

from . import _C  # noqa: E402

__all__ = [
    "BACKEND_NAME",
    "ucx_version",
    "transport_info",
    "env_knobs",
    "flight_recorder",
    "all_reduce_into",
    "algorithms",
    "set_algorithm",
    "get_algorithm",
    "cost_model",
    "set_cost_model",
    "thread_exponent",
    "set_thread_exponent",
    "predict",
    "placement",
]
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


def transport_info() -> dict[str, Any]:
    """What this process's UCX transport runs on, for checking a deployment.

    ``running``: whether a tdx group holds the transport now. ``held_bytes``: memory
    still kept for transfers that were given up on (a send that timed out or whose group
    was destroyed before its peer took it, a receive a lost peer left part-filled) while
    UCX may still read or write it; it goes back to the allocator when UCX lets go of
    them (the peer takes the message, or is seen gone: its exit on this host, or UCX's
    own peer error handling), or when the transport stops. While a group holds the
    transport: ``tcp``,
    whether UCX's TCP transport is loaded (then the process listens on a TCP port of each
    interface UCX uses), ``rndv_thresh`` (the UCX rendezvous threshold the transport set
    because this host's ranks outnumber its cores, or ``""``), and ``endpoints``, one dict
    per peer process connected so far: ``pid``, ``same_host``, ``watched`` (its exit is
    seen at once through a pidfd), ``peer_errors`` (UCX's own peer error handling, which
    rules out shared memory to it) and ``lost``.
    """
    return dict(_C.transport_info())


def env_knobs() -> list[tuple[str, str, str]]:
    """Every ``TDX_*`` knob the backend (C++) reads, as (name, default, meaning). Build
    settings (``TDX_WITH_CUDA``, ``TDX_UCX_HOME``) and ``TDX_CALIBRATION`` are in the README."""
    return list(_C.env_knobs())


def _tdx_backend_for(pg: Any, device: torch.device, unwrap: bool = True) -> Any:
    """``pg``'s tdx backend for tensors on ``device``, or None when another backend (or
    none) serves them.

    Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps every backend in a checking
    wrapper, which runs a collective of its own before each op. Queries (the flight
    record, placement, predictions) look through it (``unwrap``); an op must not, or
    this rank would skip the wrapper's check that the others run."""
    try:
        backend = pg._get_backend(device)
    except (RuntimeError, ValueError):
        return None
    if unwrap:
        wrapper = getattr(dist.distributed_c10d, "_ProcessGroupWrapper", None)
        while wrapper is not None and isinstance(backend, wrapper):
            backend = backend.wrapped_pg
    return backend if isinstance(backend, _C.ProcessGroupTDX) else None


def _this_rank() -> str:
    return str(dist.get_rank()) if dist.is_initialized() else "?"


def _tdx_backend(group: Any = None, what: str = "this call") -> Any:
    """``group``'s tdx backend (default: the world's) for a query that ``what`` names."""
    if dist.distributed_c10d._rank_not_in_group(group):
        # new_group() hands ranks outside the group a placeholder, not a ProcessGroup:
        # there is no placement, model or record of it here to answer with.
        raise ValueError(
            f"[tdx rank {_this_rank()}] {what}: this rank is not a member of the group "
            "(new_group returned a non-member placeholder here); call it only on the "
            "group's own ranks")
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"[tdx rank {_this_rank()}] {what}: group must be a process group "
                        f"(from new_group), not {type(pg).__name__}")
    for device in ("cpu", "cuda"):
        backend = _tdx_backend_for(pg, torch.device(device))
        if backend is not None:
            return backend
    raise ValueError(
        f"group {getattr(pg, 'group_name', pg)!r} has no tdx backend; pass a group created "
        "with backend='tdx'"
    )


def all_reduce_into(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Out-of-place ``all_reduce``: ``output`` receives the reduction of every rank's
    ``input``, and ``input`` is left as it was.

    torch.distributed's ``all_reduce`` works in place, so keeping the input means copying
    it first (torch's functional collectives clone it). On a ``tdx`` group with CPU
    tensors the shared-memory algorithms read ``input`` and write ``output`` as part of
    their own copies, so this costs what the in-place op does. Elsewhere (CUDA tensors,
    other backends, torch's checking wrapper under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) it
    copies ``input`` into ``output`` element by element in order, then runs
    ``dist.all_reduce(output)``.

    ``output`` needs ``input``'s dtype, device and number of elements, in any shape; it
    may be ``input`` itself or a contiguous view of all of its memory (in place), but
    must not overlap part of it. Returns a work handle when
    ``async_op`` is true, else None, like ``dist.all_reduce``.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if dist.distributed_c10d._rank_not_in_group(pg):
        return None
    where = f"[tdx rank {pg.rank()}] all_reduce_into"
    if not isinstance(output, torch.Tensor) or not isinstance(input, torch.Tensor):
        raise TypeError(
            f"{where}: output and input must be tensors, got {type(output).__name__} and "
            f"{type(input).__name__}; pass one tensor each"
        )
    if output.dtype != input.dtype or output.device != input.device \
            or output.numel() != input.numel():
        raise ValueError(
            f"{where}: output is {output.dtype}{list(output.shape)} on {output.device} but "
            f"input is {input.dtype}{list(input.shape)} on {input.device}; the output needs "
            "the input's dtype, device and number of elements"
        )
    backend = (_tdx_backend_for(pg, input.device, unwrap=False)
               if input.device.type == "cpu" else None)
    if backend is not None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        work = backend.allreduce_into(output, input, opts)
        if async_op:
            return work
        work.wait()
        return None
    if output.numel() > 0 and _overlaps(output, input):
        # In place: the input itself, or a contiguous view of all of it. An output that
        # overlaps only part of it would read values it already wrote: refused, as the
        # backend's own path refuses it.
        whole = output.data_ptr() == input.data_ptr() and (
            (output.shape == input.shape and output.stride() == input.stride())
            or (output.is_contiguous() and input.is_contiguous()))
        if not whole:
            raise ValueError(
                f"{where}: the output ({output.dtype}{list(output.shape)}) overlaps part of "
                "the input; pass the input itself (or a contiguous view of all of it) for "
                "in place, or an output of its own")
    else:
        # Any shape of the same number of elements, as on the backend's own path: copied
        # element by element in order (copy_ alone would broadcast, or refuse a reshape).
        output.copy_(input.reshape(output.shape))
    return dist.all_reduce(output, op=op, group=group, async_op=async_op)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory: one storage and intersecting byte ranges
    (strided views of one range count as sharing it)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        start = t.data_ptr()
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return start, start + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def flight_recorder(group: Any = None) -> list[dict[str, Any]]:
    """The last ops of ``group`` (default: the world) on this rank, oldest first.

    Each entry has the op's sequence number, name, description (dtype, shape, device),
    path (the algorithm that ran, or was running when the op failed, e.g. ``ring`` or
    ``shm``; ``staged <algorithm>`` for CUDA tensors staged through host memory;
    ``cuda-peer``; ``monitored`` for ``monitored_barrier``; ``host`` for a host op that
    ran no named algorithm; ``-`` before the op chose one), state (``queued``,
    ``running``, ``done``, ``failed``), the transfers it completed, its error and its
    timing. A failed or timed-out op also logs the 8 entries up to its own, and writes
    them all under ``TDX_DUMP_DIR`` when set.
    """
    return list(_tdx_backend(group, "flight_recorder").flight_record())


def algorithms(collective: str | None = None) -> dict[str, list[str]]:
    """Algorithm names per collective (``allreduce``, ``broadcast``, ``reduce``,
    ``allgather``, ``reduce_scatter``, ``alltoall``, ``barrier``, ``gather``,
    ``scatter``), as accepted by :func:`set_algorithm` and ``TDX_ALGO``.

    Names on the ``shm`` link run through a shared-memory window and need every rank of
    the group on one host.
    """
    out: dict[str, list[str]] = {}
    for a in _C._algorithms():
        out.setdefault(a["collective"], []).append(a["name"])
    if collective is not None:
        # torch.distributed's spelling, as set_algorithm and TDX_ALGO accept it.
        collective = {"all_reduce": "allreduce", "all_gather": "allgather",
                      "all_to_all": "alltoall"}.get(collective, collective)
        if collective not in out:
            raise ValueError(f"unknown collective {collective!r}; use one of {sorted(out)}")
        return {collective: out[collective]}
    return out


def set_algorithm(collective: str, name: str) -> None:
    """Pin the algorithm of ``collective`` for every tdx group of this process, for ops
    issued after this call (ops already queued keep the pins they were issued under);
    ``"auto"`` hands the choice back to the measured rules and the cost model.

    Call it with the same arguments on every rank (as with ``TDX_ALGO``): ranks that run
    different algorithms cannot meet. ``TDX_DEBUG=DETAIL`` checks this per op.
    """
    _C._set_algorithm(collective, name)


def get_algorithm(collective: str) -> str:
    """The pinned algorithm of ``collective``, or ``"auto"``."""
    return _C._get_algorithm(collective)


def cost_model() -> dict[str, dict[str, float]]:
    """This process's cost model: per link (``net`` messages between hosts, ``local``
    messages between ranks of one host, ``shm`` window copies, ``cma`` in-place reads of
    peers' memory) the seconds per step (``alpha``), per byte moved (``beta``) and per
    byte reduced (``gamma``).

    Groups created afterwards use rank 0's model, so all ranks choose alike.
    """
    return dict(_C._cost_model())


def set_cost_model(model: dict[str, dict[str, float]]) -> None:
    """Replace links of the cost model (for groups created afterwards): ``{link: {"alpha":
    a, "beta": b, "gamma": c}}`` for any of the links :func:`cost_model` names, each term
    a finite number of seconds >= 0 (any real number but a bool: numpy scalars too).
    Checked as a calibration file's links are, by the same rules: a link missing a term, a
    term that is not such a number, or an unknown link is a TypeError or ValueError naming
    the link and term at fault, and nothing changes; keys other than the three terms are
    ignored, as in a file."""
    _C._set_cost_model(_calibration.check_links(model, "set_cost_model"))


def thread_exponent() -> float:
    """The cost model's thread exponent p: a pass of the shared-memory all_reduce split over
    T threads per rank (``placement(group)["pass_threads"]``) is priced T**p times faster
    than on one. 0.5 by default; ``python -m torchdist_ext.bench calibrate`` fits it where
    the ranks get several threads. Groups use their rank 0's."""
    return float(_C._thread_exponent())


def set_thread_exponent(exponent: float) -> None:
    """Set the thread exponent (see :func:`thread_exponent`) for groups created
    afterwards: a real number from 0 (threads give nothing) to 1 (T threads, T times
    faster); anything else is a TypeError or ValueError, and nothing changes."""
    if _calibration.as_real(exponent) is None:
        raise TypeError(f"set_thread_exponent: the exponent must be a number, not "
                        f"{type(exponent).__name__} {_calibration._shown(exponent)}")
    if not _calibration._exponent(exponent):  # the file's rule for it
        raise ValueError(f"set_thread_exponent: the exponent must be from 0 to 1, got "
                         f"{_calibration._shown(exponent)}")
    _C._set_thread_exponent(float(exponent))


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is a whole number: an integer (numpy's too) or a real
    number with no fraction (``4.0``); else None. Never a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    x = _calibration.as_real(value)
    return int(x) if x is not None and math.isfinite(x) and x.is_integer() else None


def _check_predict(collective: Any, nbytes: Any, world: Any) -> tuple[float, int | None]:
    """``nbytes`` as a float and ``world`` as an int (or None), or a TypeError or
    ValueError naming the argument: the backend would price a negative or NaN size, or a
    world of 0, without complaint, and a huge world fails in pybind's conversion."""
    shown = _calibration._shown  # values cut short: one line per error
    if not isinstance(collective, str):
        raise TypeError(f"predict: collective must be a name such as 'allreduce' "
                        f"(torchdist_ext.algorithms() lists them), not "
                        f"{type(collective).__name__}")
    size = _calibration.as_real(nbytes)
    if size is None:
        raise TypeError(f"predict: nbytes must be a number of bytes, not "
                        f"{type(nbytes).__name__} {shown(nbytes)}")
    if not (math.isfinite(size) and size >= 0):
        raise ValueError(f"predict: nbytes must be a finite number >= 0, got {shown(nbytes)}")
    if world is None:
        return size, None
    ranks = _whole(world)
    if ranks is None:
        raise TypeError(f"predict: world must be a whole number of ranks, not "
                        f"{type(world).__name__} {shown(world)}")
    limit = _calibration.MAX_WORLD
    if not 1 <= ranks <= limit:
        raise ValueError(f"predict: world must be from 1 to {limit} ranks, got {shown(ranks)}")
    return size, ranks


def predict(collective: str, nbytes: int, world: int | None = None, same_host: bool = True,
            one_host: bool = False, crowded: bool = False,
            group: Any = None, pass_threads: int = 1) -> tuple[str, float]:
    """What ``auto`` (or the pinned algorithm) picks for an op, and its predicted seconds.
    Auto follows a measured rule (``python -m torchdist_ext.bench tune``) that matches the
    op (collective, size, world, placement, crowding and ``pass_threads``) and can run it,
    else the cheapest algorithm by the cost model.

    With ``group``, or without ``world`` (then the default group): what that tdx group
    would run now, from its size, its placement as its ranks agreed, its cost model (its
    rank 0's, which every rank of it uses) and the algorithms pinned at this moment.

    With ``world`` (a whole number from 1 to 2**24: an int, a numpy integer or a float
    such as ``4.0``): a group of that size, described by the flags and priced
    with this process's cost model. ``same_host``: every rank on one host with its
    shared-memory windows; ``one_host`` alone: on one host with ``TDX_SHM=0`` (messages
    priced as same-host ones, no windows). Both False: ranks on several hosts.
    ``crowded`` (with one host, so an error when both are False): the ranks outnumber the
    host's CPUs, so each message step also pays a wake-up (``TDX_CROWDED_STEP_US``).
    ``pass_threads`` (with ``same_host``; 1 to 16): the threads each rank splits the
    window all_reduce's copies and reductions over (``TDX_SHM_THREADS``; a group's own is
    ``placement(group)["pass_threads"]``).

    ``nbytes`` must be a finite number >= 0; a bad argument is a TypeError or ValueError
    naming it."""
    size, world = _check_predict(collective, nbytes, world)
    if group is not None or world is None:
        if world is not None:
            raise ValueError("predict takes a world size or a group, not both: a group's "
                             "size, placement and cost model are its own")
        name, seconds = _tdx_backend(group, "predict").predict(collective, size)
        return name, float(seconds)
    if crowded and not (same_host or one_host):
        # Crowding is a property of one host's CPUs; ranks on several hosts are never
        # priced as crowded, so the flag would be silently dropped.
        raise ValueError("predict: crowded=True describes ranks that share one host's CPUs; "
                         "pass same_host=True or one_host=True with it, or drop it")
    threads = _whole(pass_threads)
    if threads is None or not 1 <= threads <= _calibration.MAX_THREADS:
        raise ValueError(f"predict: pass_threads must be a whole number from 1 to "
                         f"{_calibration.MAX_THREADS}, got "
                         f"{_calibration._shown(pass_threads)}")
    if threads > 1 and not same_host:
        raise ValueError("predict: pass_threads above 1 describes the shared-memory "
                         "windows' all_reduce; pass same_host=True with it, or drop it")
    return tuple(_C._choose_algorithm(collective, size, world, bool(same_host),
                                      bool(one_host), bool(crowded), threads))


def placement(group: Any = None) -> dict[str, Any]:
    """Where ``group``'s ranks are (default: the world), as its ranks agreed at creation:
    ``one_host`` (every rank on this host: same boot id and mount, IPC and pid
    namespaces; messages are priced on the ``local`` link), ``windows`` (that, with
    ``TDX_SHM`` not 0 on every rank: shared-memory algorithms may run) and ``crowded``
    (one host, and the group's ranks outnumber the CPUs they may run on together: each
    message step is priced with a wake-up, ``TDX_CROWDED_STEP_US``), and
    ``pass_threads`` (an int: the threads each rank splits the window all_reduce's copies
    and reductions over, ``TDX_SHM_THREADS``; 1 without windows)."""
    return dict(_tdx_backend(group, "placement").placement)


from . import calibration as _calibration  # noqa: E402

# A bad or unreadable file is a warning inside (the backend keeps its defaults, or drops
# the bad rules); anything else that raises here is a bug to see, not a file to blame.
_calibration.load_into_backend()

if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


def _shut_down_at_exit() -> None:
    """Shuts down the tdx groups a program leaves alive at exit (it never called
    ``destroy_process_group``), while Python is still whole.

    Otherwise a group's worker thread could let go of an op's tensors only once the
    interpreter is finalizing: freeing a tensor's Python object then takes the GIL,
    which ends the thread in the middle of a destructor, and the process aborts
    ("terminate called without an active exception"). Shutting down also says goodbye
    to the peers, so a rank that exits first does not cut off one still reading its
    messages. Subgroups go first, then the default group."""
    try:
        groups = list(dist.distributed_c10d._world.pg_map)
    except Exception:  # noqa: BLE001 - torch's internals moved: nothing to do here
        return
    for group in reversed(groups):
        for device in ("cpu", "cuda"):
            try:
                backend = group._get_backend(torch.device(device))
            except Exception:  # noqa: BLE001 - no backend for that device
                continue
            if isinstance(backend, _C.ProcessGroupTDX):
                backend.shutdown()  # a second call (the same backend for both) does nothing


atexit.register(_shut_down_at_exit)
