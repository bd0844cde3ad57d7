"""The matrix-preconditioned built-ins (SOAP, Shampoo, PSGDKron) on DTensor parameters
sharded by rows (2 gloo processes): each full gradient matrix is gathered once a step onto
the rank that owns its matrix work (one all_to_all for all of them), that rank alone runs
it, and every rank gets its rows back (one more all_to_all), so each rank's shards follow
the same optimizer on the whole tensors in one process. The owner keeps the factors;
state_dict() publishes states of a parameter's shape as DTensors like it and the factors
replicated, which torch.distributed.checkpoint saves on 2 ranks and loads into one
process, and a state dict of whole tensors loads on the ranks.

Bit for bit: an owner batches its own parameters' matrix work only, and on CPU MKL's
torch.bmm, eigh and qr round some sizes (9x9 products, odd sizes from 7) differently at
another place of a batch. These layouts keep such batches as in one process (the one
factor of size 7 is alone in its batch, both (6, 11) matrices are on rank 0), so equality
is exact whatever the seed, and a wrong row, a missing gather or a stale factor shows; two
9x7 matrices on different owners would differ by that rounding (docs/distributed.md)."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

import fuser

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

import precond_ranks  # noqa: E402
from published import kinds  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402

# Wide, tall (shards of 6 and 5 rows), a matrix over the factor size limit of 8 (no factor
# for SOAP; 4 blocks for Shampoo; diagonal factors for PSGDKron), a 1-D tensor, one whose
# second shard is empty, a replicated matrix, and another of the first's shape (PSGDKron's
# first scale is one for both, from both gradients).
LAYOUTS = [
    ((6, 11), Shard(0)),
    ((11, 5), Shard(0)),
    ((9, 10), Shard(0)),
    ((7,), Shard(0)),
    ((1, 6), Shard(0)),
    ((5, 4), Replicate()),
    ((6, 11), Shard(0)),
]
FACTORS = {"SOAP": "GG", "Shampoo": "factor_matrices", "PSGDKron": "Q"}  # a factor state's key
OPTIMIZERS = {
    # factors from step 1, refreshed (QR) at step 3
    "SOAP": lambda ps: fuser.optim.SOAP(
        ps, lr=0.01, precondition_frequency=2, max_precondition_dim=8, precondition_1d=True
    ),
    # grafting only at step 1, roots from step 2, refreshed every step; blocks of 8, momentum
    "Shampoo": lambda ps: fuser.optim.Shampoo(
        ps,
        lr=0.01,
        momentum=0.5,
        max_preconditioner_dim=8,
        precondition_frequency=1,
        start_preconditioning_step=2,
    ),
    # a fit every step (heavyball's schedule), its first scale from all first gradients of
    # a shape, triangular factors up to 8
    "PSGDKron": lambda ps: fuser.optim.PSGDKron(ps, lr=0.01, weight_decay=0.01, max_size_triangular=8),
}


def worker(rank, world, name, path, whole_sd):
    return precond_ranks.worker(rank, world, OPTIMIZERS[name], LAYOUTS, FACTORS[name], path, whole_sd)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_row_shards_follow_the_optimizer_on_whole_tensors(tmp_path, name):
    path = str(tmp_path / "dcp")
    sd, params, then = precond_ranks.single_process(OPTIMIZERS[name], LAYOUTS)
    ranks = run_ranks(worker, name, path, sd)
    # each sharded parameter to the rank owning the fewest elements so far (66, 55, 90,
    # 7, 6, 66 elements), which alone holds its factors; SOAP's and Shampoo's other rank
    # holds the marker (PSGDKron's its shards of exp_avg and update)
    owners = [0, 1, 1, 0, 0, None, 0]
    for rank, got in enumerate(ranks):
        assert got["holds"] == [o in (None, rank) for o in owners], (rank, got["holds"])
        if name != "PSGDKron":
            assert got["marks"] == [None if o in (None, rank) else o for o in owners], (rank, got["marks"])

    def kind_of(key, value, p):
        per_element = torch.is_tensor(value) and value.shape == p.shape
        return "DTensor" if per_element else kinds(value)

    precond_ranks.assert_ranks_follow(ranks, name, LAYOUTS, sd, params, then, kind_of)
    precond_ranks.load_checkpoint_into_one_process(OPTIMIZERS[name], LAYOUTS, name, path, sd, params, then)


def refused_worker(rank, world, names):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    columns, uneven = precond_ranks.refused_layouts(rank, mesh)
    return [
        precond_ranks.refusal(make, lambda p, name=name: OPTIMIZERS[name]([p]))
        for name in names
        for make in (columns, uneven)
    ]


def test_layouts_other_than_row_shards_are_refused_before_any_change():
    names = list(OPTIMIZERS)
    for messages in run_ranks(refused_worker, names):
        for name, (columns, uneven) in zip(names, zip(messages[::2], messages[1::2])):
            assert columns is not None and "shard it by rows" in columns[0] and name in columns[0], columns
            assert uneven is not None and "torch.chunk's split" in uneven[0], uneven
            assert columns[1:] == (True, 0) and uneven[1:] == (True, 0), (name, columns, uneven)
