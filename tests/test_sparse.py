"""Sparse COO all_reduce (SUM, AVG, PREMUL_SUM), as gloo has it and DDP uses it for sparse
gradients: checked against a float64 dense reference, against gloo, and by DDP over an
nn.Embedding(sparse=True) against single-process training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torchdist_ext.testing import run_ranks


def _sparse_of(rank: int, dtype: torch.dtype, dense_dim: bool) -> torch.Tensor:
    """Rank r's tensor: rows that overlap other ranks', a duplicate (uncoalesced) index,
    and nothing at all on rank 2."""
    shape = (11, 3) if dense_dim else (11,)
    if rank == 2:
        idx = torch.zeros(1, 0, dtype=torch.long)
        vals = torch.zeros((0, 3) if dense_dim else (0,))
    else:
        rows = [rank % 11, (rank * 5 + 1) % 11, 7, 7]
        idx = torch.tensor([rows])
        vals = torch.arange(1, 5, dtype=torch.float64) * (rank + 1)
        if dense_dim:
            vals = vals[:, None] * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    return torch.sparse_coo_tensor(idx, vals.to(dtype), shape, check_invariants=True)


def _reference(n: int, dtype: torch.dtype, dense_dim: bool) -> torch.Tensor:
    return sum(_sparse_of(r, torch.float64, dense_dim).to_dense() for r in range(n))


def _sparse_sums(rank: int, n: int) -> list[str]:
    fails = []
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        for dense_dim in (False, True):
            t = _sparse_of(rank, dtype, dense_dim)
            dist.all_reduce(t)
            want = _reference(n, dtype, dense_dim)
            if not t.is_sparse or not torch.allclose(t.to_dense().double(), want):
                fails.append(f"SUM {dtype} dense_dim={dense_dim}: {t.to_dense().tolist()}")
            if t.is_sparse and not t.is_coalesced():
                fails.append(f"SUM {dtype}: result not coalesced")
    t = _sparse_of(rank, torch.float32, True)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    if not torch.allclose(t.to_dense().double(), _reference(n, torch.float64, True) / n):
        fails.append(f"AVG: {t.to_dense().tolist()}")
    t = _sparse_of(rank, torch.float64, False)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    if not torch.allclose(t.to_dense(), _reference(n, torch.float64, False) * 0.5):
        fails.append(f"PREMUL_SUM: {t.to_dense().tolist()}")
    # Asynchronous: the future's value is the tensor, reduced in place.
    t = _sparse_of(rank, torch.float32, False)
    work = dist.all_reduce(t, async_op=True)
    got = work.get_future().wait()[0]
    if got is not t and not torch.equal(got.to_dense(), t.to_dense()):
        fails.append("future value is not the reduced tensor")
    if not torch.allclose(t.to_dense().double(), _reference(n, torch.float64, False)):
        fails.append(f"async SUM: {t.to_dense().tolist()}")
    d = torch.ones(4)
    dist.all_reduce(d)
    if d.tolist() != [float(n)] * 4:
        fails.append(f"dense after sparse: {d.tolist()}")
    return fails


@pytest.mark.parametrize("world,shm", [(1, "1"), (2, "1"), (3, "1"), (3, "0"), (5, "1")])
def test_sparse_all_reduce_matches_a_dense_reference(world: int, shm: str) -> None:
    fails = [f for r in run_ranks(_sparse_sums, world, timeout=120, env={"TDX_SHM": shm})
             for f in r]
    assert not fails, "\n".join(fails)


def _against(rank: int, n: int) -> list:
    t = _sparse_of(rank, torch.float32, True)
    dist.all_reduce(t)
    t = t.coalesce()
    return [t.indices().tolist(), t.values().tolist()]


def test_sparse_all_reduce_agrees_with_gloo() -> None:
    assert run_ranks(_against, 3, timeout=120) == run_ranks(_against, 3, backend="gloo",
                                                            timeout=120)


def _duplicates(rank: int, n: int) -> list[list[float]]:
    """Duplicate indices within a rank are summed before the ranks' shares meet, as a
    dense tensor holds them: 1e8 and -1e8 at one index cancel before rank 0's 1.0 is
    added (summed together with it in one pass they lose it), and an integer PREMUL_SUM
    scales each rank's summed share, not each duplicate, before truncating."""
    if rank == 0:
        t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (2,))
    else:
        t = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([1e8, -1e8]), (2,))
    dist.all_reduce(t)
    ints = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([1, 1]), (2,))
    dist.all_reduce(ints, op=dist._make_nccl_premul_sum(0.5))
    return [t.to_dense().tolist(), ints.to_dense().tolist()]


def test_duplicate_indices_are_summed_within_a_rank_first() -> None:
    for got in run_ranks(_duplicates, 2, timeout=60):
        assert got == [[1.0, 0.0], [2, 0]], got


def _other_dims(rank: int, n: int) -> str:
    shape = (3, 3) if rank == 0 else (3, 3, 2)
    idx = torch.zeros(len(shape), 1, dtype=torch.long)
    t = torch.sparse_coo_tensor(idx, torch.ones(1), shape, check_invariants=True)
    try:
        dist.all_reduce(t)
        return "no error"
    except dist.DistBackendError as e:
        return str(e)


def test_ranks_of_another_dimension_count_are_named_with_their_shapes() -> None:
    """The exchanged shape records have one length whatever the dimensions, so the
    error compares the tensors, not the sizes of an internal message."""
    for msg in run_ranks(_other_dims, 2, timeout=60):
        assert "passed a sparse tensor Float[3, 3" in msg, msg
        assert "Float[3, 3, 2] with sparse_dim 3" in msg, msg


def _refused(rank: int, n: int) -> list[str]:
    msgs = []
    try:
        dist.all_reduce(_sparse_of(rank, torch.float32, False), op=dist.ReduceOp.MAX)
        msgs.append("MAX ok")
    except ValueError as e:
        msgs.append(str(e))
    try:
        dist.all_reduce(torch.ones(3, 3).to_sparse_csr())
        msgs.append("CSR ok")
    except (TypeError, ValueError, RuntimeError) as e:
        msgs.append(str(e))
    # Refused at the call: the group still works.
    d = torch.ones(2)
    dist.all_reduce(d)
    msgs.append(str(d.tolist()))
    # Ranks whose tensors differ in size learn it from the exchanged shapes, as a
    # mismatch that ends the group (as any collective mismatch does).
    t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (5 if rank == 0 else 6,),
                                check_invariants=True)
    try:
        dist.all_reduce(t)
        msgs.append("size mismatch ok")
    except dist.DistBackendError as e:
        msgs.append(str(e))
    return msgs


def test_sparse_all_reduce_refuses_what_it_cannot_reduce() -> None:
    for rank, msgs in enumerate(run_ranks(_refused, 2, timeout=60)):
        assert "sparse" in msgs[0] and msgs[0].endswith(".to_dense() for MAX"), msgs
        assert f"[tdx r{rank}/2" in msgs[0], msgs
        assert "CSR ok" != msgs[1], msgs  # torch's dispatcher refuses it, as for gloo
        assert msgs[2] == "[2.0, 2.0]", msgs
        assert "passed a sparse tensor Float[" in msgs[3], msgs
        assert "Float[5]" in msgs[3] and "Float[6]" in msgs[3], msgs


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1)).squeeze(1)


def _batches(steps: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 50, (4 * world, 5), generator=g),
             torch.randn(4 * world, generator=g)) for _ in range(steps)]


def _train(model: nn.Module, batches, rank: int, world: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids, y in batches:
        ids, y = ids.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(ids), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _ddp(rank: int, n: int) -> dict:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_Bag())
    losses = _train(model, _batches(6, n), rank, n)
    # Lists, not tensors: a tensor crosses the result queue as shared memory whose
    # sender may have exited by the time it is read.
    return {"losses": losses, "params": [p.detach().tolist() for p in model.module.parameters()]}


def test_ddp_over_a_sparse_embedding_matches_single_process_training() -> None:
    world = 3
    torch.manual_seed(0)
    single = _Bag()
    single_losses = _train(single, _batches(6, world), 0, 1)
    got = run_ranks(_ddp, world, timeout=180)
    for rank, r in enumerate(got):
        for p, q in zip(r["params"], single.parameters()):
            p = torch.tensor(p)
            assert torch.allclose(p, q.detach(), atol=1e-5), (rank, (p - q).abs().max())
        assert r["params"] == got[0]["params"]  # every replica the same, bit for bit
    # Each rank's loss is over its third of the batch: their mean is the whole batch's.
    for step, want in enumerate(single_losses):
        mean = sum(r["losses"][step] for r in got) / world
        assert abs(mean - want) < 1e-5, (step, mean, want)


def _cuda_sparse(rank: int, n: int) -> list[str]:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    t = _sparse_of(rank, torch.float32, True).cuda()
    dist.all_reduce(t)
    if not t.is_cuda or not torch.allclose(t.to_dense().cpu().double(),
                                           _reference(n, torch.float64, True)):
        return [f"cuda sparse SUM: {t}"]
    return []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_sparse_all_reduce() -> None:
    fails = [f for r in run_ranks(_cuda_sparse, 3, timeout=120) for f in r]
    assert not fails, "\n".join(fails)
