"""``python -m torchdist_ext.bench zero``: a training step under DDP and ZeRO-1, 2 and 3.

Per model size and backend, the time of one step (forward, backward, Adam step) of an MLP
of ``--layers`` square linear layers, each rank on a batch of its own, with the gradients
averaged by torch's DistributedDataParallel (``ddp``) or by
:class:`torchdist_ext.parallel.ZeroOptimizer` at stage 1 (``zero1``), 2 (``zero2``) or 3
(``zero3``, each linear layer a unit); and what each rank holds after the backward pass:
optimizer state, gradients and parameters, in bytes (counted from the tensors; the same
on every backend). On CUDA, the peak of
torch's allocator over the timed steps as well. Times are the largest over the ranks
of the mean over ``--iters`` steps, after ``--warmup``. ``--compression int8|sign|topk``
sends every strategy's gradients compressed, with error feedback: DDP through
:func:`torchdist_ext.compression.ddp_comm_hook`, ZeRO through ``ZeroConfig(compression=)``
(its reduce_scatter); the residuals and buffers count among the gradients' bytes.
DDP's hook reduces Int8's and Sign's buckets on a thread of their own while backward goes
on (``CompressionState(overlap=True)``) unless ``--no-overlap``.
``--param-dtype bfloat16`` (or ``float16``) runs ZeRO in mixed precision
(``ZeroConfig(param_dtype=)``: the model computes, gathers and reduces in that dtype over
float32 shards); DDP stays in float32.

Usage::

    python -m torchdist_ext.bench zero                          # tdx and gloo, 2 ranks
    python -m torchdist_ext.bench zero --world 4 --params 4M,32M --strategies ddp,zero2
    python -m torchdist_ext.bench zero --compression int8
    python -m torchdist_ext.bench zero --param-dtype bfloat16
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import compression as tc
from ..parallel import ZeroConfig, ZeroOptimizer
from . import report, runner
from .core import names_arg, size_arg, sizes_arg
from .runner import time_per_call

__all__ = ["ZeroBenchOptions", "build_parser", "check_training_options", "main", "run",
           "square_mlp", "square_width", "table_lines"]

_BACKENDS = ("tdx", "gloo")
_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
_COMPRESSION = ("none", "int8", "sign", "topk")
_PARAM_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ZeroBenchOptions:
    """One run: ``world`` spawned ranks (ignored under torchrun); for each of ``params``
    (trainable float32 parameters, about), each strategy on each backend."""

    world: int = 2
    backends: tuple[str, ...] = _BACKENDS
    strategies: tuple[str, ...] = _STRATEGIES
    params: tuple[int, ...] = (1 << 20, 1 << 23)
    layers: int = 4
    batch: int = 32
    bucket_bytes: int = 16 << 20
    compression: str = "none"
    param_dtype: str = "float32"
    overlap: bool = True
    device: str = "cpu"
    iters: int = 5
    warmup: int = 2
    timeout: float = 300.0
    json_path: str | None = None

    def __post_init__(self) -> None:
        runner.check_side_options(self, _BACKENDS)
        check_training_options(self, _STRATEGIES)
        ZeroConfig(bucket_bytes=self.bucket_bytes)  # its own check names the fix
        if self.compression not in _COMPRESSION:
            raise ValueError(f"compression (--compression) takes none, int8, sign or topk, "
                             f"not {self.compression!r}")
        if self.param_dtype not in _PARAM_DTYPES:
            raise ValueError(f"param_dtype (--param-dtype) takes float32, bfloat16 or "
                             f"float16, not {self.param_dtype!r}")

    def method(self) -> tc.Method | None:
        """The compression method of ``compression``: int8 and sign in blocks of 256,
        topk keeping 1 % of each bucket; None for none."""
        return {"none": None, "int8": tc.Int8(), "sign": tc.Sign(),
                "topk": tc.TopK(0.01)}[self.compression]

    def width(self, params: int) -> int:
        return square_width(params, self.layers)


def check_training_options(opts: Any, strategies: Sequence[str]) -> None:
    """The checks of the training-step benches (zero, ps): ``strategies`` named from
    ``strategies``, each once; a model of ``layers`` layers and ``params`` sizes of at
    least one parameter per layer; a ``batch`` of at least 1."""
    if not opts.strategies or any(s not in strategies for s in opts.strategies) \
            or len(set(opts.strategies)) != len(opts.strategies):
        names = ", ".join(strategies[:-1]) + f" and/or {strategies[-1]}"
        raise ValueError(f"strategies (--strategies) take {names}, each once, not "
                         f"{','.join(opts.strategies)!r}")
    if opts.layers < 1 or opts.batch < 1:
        raise ValueError(f"layers (--layers) and batch (--batch) must be at least 1, not "
                         f"{opts.layers} and {opts.batch}")
    if not opts.params or any(p < opts.layers for p in opts.params):
        raise ValueError(f"params (--params) must be parameter counts of at least one per "
                         f"layer ({opts.layers}), not {','.join(map(str, opts.params))}")


def square_width(params: int, layers: int) -> int:
    """The width at which ``layers`` square linear layers with biases hold about
    ``params`` parameters."""
    return max(1, int(math.sqrt(params / layers)))


def square_mlp(params: int, layers: int, device: torch.device) -> nn.Module:
    """The benches' model: ``layers`` square linear layers, tanh between, about
    ``params`` parameters, the same weights on every rank."""
    torch.manual_seed(0)
    w = square_width(params, layers)
    out: list[nn.Module] = []
    for _ in range(layers):
        out += [nn.Linear(w, w), nn.Tanh()]
    return nn.Sequential(*out).to(device)


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _strategy(name: str, model: nn.Module, group: Any, opts: ZeroBenchOptions):
    """(the module to call, the optimizer, a function of the bytes held after backward,
    one that releases what the strategy made: the compressed hook's thread and group)."""
    if name == "ddp":
        ddp = nn.parallel.DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=opts.bucket_bytes / 2 ** 20)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        method = opts.method()
        # On DDP's group: the default group is the bench's own (gloo), not the backend
        # measured. The overlap's group is made here, by every rank alike.
        hook_state = own = None
        if method is not None:
            overlap = opts.overlap and not isinstance(method, tc.TopK)
            own = dist.new_group(backend=dist.get_backend(group)) if overlap else None
            hook_state = tc.CompressionState(method, group=group, overlap=overlap,
                                             overlap_group=own)
        if hook_state is not None:
            ddp.register_comm_hook(hook_state, tc.ddp_comm_hook)

        def held() -> dict[str, int]:
            grads = _nbytes(p.grad for p in model.parameters())
            if hook_state is not None:  # the residuals error feedback keeps, its buffers
                grads += hook_state.feedback.nbytes()
            return {"state": _nbytes(v for st in opt.state.values() for v in st.values()),
                    "grads": grads, "weights": _nbytes(model.parameters())}
        def close() -> None:
            if hook_state is not None:
                hook_state.close()
            if own is not None:
                dist.destroy_process_group(own)
        return ddp, opt, held, close
    stage = int(name[-1])
    config = ZeroConfig(stage=stage, bucket_bytes=opts.bucket_bytes,
                        units=(nn.Linear,) if stage == 3 else (),
                        compression=opts.method(), error_feedback=True,
                        param_dtype=_PARAM_DTYPES[opts.param_dtype])
    opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, group=group, config=config,
                        module=model, lr=1e-4)

    def held() -> dict[str, int]:
        mem = opt.memory()
        return {"state": mem["state"], "grads": mem["grads"], "weights": mem["params"]}
    return model, opt, held, lambda: None


def _backend_rows(opts: ZeroBenchOptions, group: Any, world: int, rank: int,
                  device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(rank)
    for params in opts.params:
        row: dict[str, Any] = {}
        w = opts.width(params)
        x = torch.randn(opts.batch, w, generator=gen).to(device)
        for name in opts.strategies:
            model = square_mlp(params, opts.layers, device)
            numel = sum(p.numel() for p in model.parameters())  # stage 3 empties them
            module, opt, held, close = _strategy(name, model, group, opts)

            def step(_: int) -> None:
                opt.zero_grad(set_to_none=True)
                module(x).square().mean().backward()
                opt.step()

            for i in range(opts.warmup):
                step(i)
            opt.zero_grad(set_to_none=True)
            module(x).square().mean().backward()
            cell = {"params": numel, **held()}
            opt.step()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            cell["ms"] = time_per_call(step, opts.iters, device) * 1e3
            if device.type == "cuda":
                cell["peak"] = torch.cuda.max_memory_allocated(device)
            row[name] = cell
            close()
        out[str(params)] = row
    return out


def _rank_main(rank: int, world: int, opts: Any,
               local_rank: int | None = None) -> dict[str, Any]:
    """One rank of a run: every backend's results."""
    return runner.side_rank("training step: " + ", ".join(_STRATEGIES), _backend_rows, rank,
                            world, opts, local_rank)


def run(opts: ZeroBenchOptions) -> dict[str, Any]:
    """Measure; rank 0's results (every rank's under torchrun)."""
    return runner.run_side(opts, _rank_main)


def table_lines(data: dict[str, Any]) -> list[str]:
    """The text table of a run's results."""
    o = data["options"]
    names = list(data["backends"])
    cuda = o["device"] == "cuda"
    lines = [f"# one training step (forward, backward, Adam) of an MLP of {o['layers']} "
             f"square layers, batch {o['batch']} per rank, {data['world']} rank(s), "
             f"{o['device']}, gradients compressed: {o.get('compression', 'none')}, "
             f"ZeRO parameters in {o.get('param_dtype', 'float32')}, "
             f"DDP's compressed buckets {'overlapping' if o.get('overlap') else 'inline'}, "
             f"{data['host']}, {data['date']}",
             f"# time: the largest over the ranks of the mean of {o['iters']} steps, in ms; "
             f"state, grads, params: bytes a rank holds after backward"
             + ("; peak: torch's allocator over the steps" if cuda else "")]
    head = (f"{'params':>10} {'strategy':>9} {'state/rank':>11} {'grads/rank':>11} "
            f"{'params/rank':>11}")
    for n in names:
        head += f" {n + ' ms':>10}" + (f" {n + ' peak':>11}" if cuda else "")
    lines.append(head)
    for params in o["params"]:
        for name in o["strategies"]:
            first = data["backends"][names[0]][str(params)][name]
            line = (f"{first['params']:>10} {name:>9} {report.bytes_text(first['state']):>11} "
                    f"{report.bytes_text(first['grads']):>11} "
                    f"{report.bytes_text(first['weights']):>11}")
            for n in names:
                cell = data["backends"][n][str(params)][name]
                line += f" {cell['ms']:>10.2f}"
                if cuda:
                    line += f" {report.bytes_text(cell['peak']):>11}"
            lines.append(line)
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchdist_ext.bench zero",
        description="Time a training step under DDP and ZeRO-1, 2 and 3 and count what "
                    "each rank holds, several backends side by side.",
        epilog="Under torchrun the ranks come from the environment and --world is ignored.")
    p.add_argument("--backends", default="tdx,gloo", help="tdx and/or gloo (default both)")
    p.add_argument("--strategies", default=",".join(_STRATEGIES),
                   help="ddp, zero1, zero2 and/or zero3 (default all)")
    p.add_argument("--params", type=sizes_arg, default=(1 << 20, 1 << 23),
                   help="comma-separated model sizes in parameters, K/M suffixes "
                        "(default 1M,8M)")
    p.add_argument("--layers", type=int, default=4, help="square linear layers (default 4)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank (default 32)")
    p.add_argument("--bucket-bytes", type=size_arg, default=16 << 20,
                   help="bucket size of DDP and ZeRO, K/M suffixes (default 16M)")
    p.add_argument("--compression", default="none",
                   help="none, int8, sign or topk: every strategy's gradients compressed, "
                        "with error feedback (default none)")
    p.add_argument("--param-dtype", default="float32",
                   help="float32, bfloat16 or float16: ZeRO's parameters in that dtype over "
                        "float32 shards (mixed precision); DDP stays float32 (default "
                        "float32)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="with --compression int8 or sign, DDP's hook reduces each bucket "
                        "before backward goes on (CompressionState(overlap=False))")
    runner.add_side_arguments(p, iters=5, warmup=2, what="steps")
    return p


def _options(a: argparse.Namespace) -> ZeroBenchOptions:
    return ZeroBenchOptions(world=a.world, backends=names_arg(a.backends),
                            strategies=names_arg(a.strategies), params=a.params,
                            layers=a.layers, batch=a.batch, bucket_bytes=a.bucket_bytes,
                            compression=a.compression, param_dtype=a.param_dtype,
                            overlap=a.overlap,
                            device=a.device, iters=a.iters, warmup=a.warmup,
                            timeout=a.timeout, json_path=a.json_path)


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every step ran (a backend that fails raises)."""
    runner.side_main(build_parser(), argv, _options, run, table_lines)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
