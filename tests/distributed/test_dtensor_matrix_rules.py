"""Optimizers of matrix rules (``fuser.compile`` of a rule with matrix states) on DTensor
parameters sharded by rows (2 gloo processes), against the same optimizer on the whole
tensors in one process: each full gradient is gathered once a step onto the rank that owns
its matrix work (one all_to_all for all of them), that rank alone runs both phases of the
step on the whole tensor, and every rank gets its rows back (one more all_to_all). The
owner keeps every state; state_dict() publishes the element states as DTensors like the
parameter and the matrix, row, column and per-tensor states replicated, which
torch.distributed.checkpoint saves on 2 ranks and loads into one process.

The rules: the zoo's SOAP (eigh at step 1, a QR refresh with sort_perm at step 3), its
``soap_dims`` (per-dimension factors, kept as ``F[0]``, ``F[1]``, ...), its ``kron_dims``
with ``diagonal_dims`` (triangular and diagonal factors, random probes) and a
Shampoo-like rule with a state of one number per tensor, one per row and one per column
(inverse roots at steps 1 and 3). Bit for bit, as in test_dtensor_precond.py: an owner
batches its own parameters' matrix work, and on CPU MKL rounds some sizes of products and
decompositions (docs/distributed.md) differently at another place of a batch; here both
(6, 11) matrices are on rank 0 and every other shape occurs once, so each batch is as in
one process whatever the sizes."""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch
from ranks import run_ranks

import fuser

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import precond_ranks  # noqa: E402
from precond_ranks import data, one_thread  # noqa: E402
from published import local_value, rows_of  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402
from zoo import ZOO  # noqa: E402

ROWED = fuser.rule(
    """
    L = beta * L + (1 - beta) * g @ transpose(g)
    bound = maximum(beta * bound, norm(L))
    r = beta * r + (1 - beta) * rowmean(g**2)
    c = beta * c + (1 - beta) * colmean(g**2)
    PL = where(mod(step - 1, 2) == 0, inv_root(L / bound + eps * eye(rows), 4), PL)
    m = beta * m + (1 - beta) * g
    p = p - lr * (PL @ m) / sqrt(r * c + eps)
    """,
    name="rowed",
    hyper=dict(lr=0.05, beta=0.9, eps=1e-3),
    state=dict(L="zeros(rows, rows)", PL="eye(rows)", bound=0.0, r=0.0, c=0.0, m=0.0),
)
RULES = {"soap": ZOO["soap"].rule, "soap_dims": ZOO["soap_dims"].rule, "rowed": ROWED, "rowed_bf16": ROWED}
RULES["kron_diagonal"] = ZOO["kron_dims"].rule
OPTIONS = {"rowed_bf16": dict(state_dtype=torch.bfloat16)}  # (its momentum m stored in bf16)
HYPER = {
    "soap": dict(
        lr=1e-2, beta1=0.9, beta2=0.8, shampoo_beta=0.7, weight_decay=0.1, precondition_frequency=2.0
    ),
    "rowed": dict(lr=0.05),
    "rowed_bf16": dict(lr=0.05),
}
HYPER["soap_dims"] = HYPER["soap"]


def kron_diagonal(shape) -> tuple:
    """PSGD Kron's diagonal factors: sizes 1, over 5 and 1-D tensors (a mix in each layout)."""
    return tuple(d == 1 or d > 5 or len(shape) < 2 for d in shape)


HYPER["kron_diagonal"] = dict(ZOO["kron_dims"].hyper, diagonal_dims=kron_diagonal)
# the states of the parameter's layout
ELEMENT_STATES = {"soap": {"m", "v"}, "soap_dims": {"m", "v"}, "rowed": {"m"}, "rowed_bf16": {"m"}}
ELEMENT_STATES["kron_diagonal"] = {"momentum_buffer"}

# Wide (11 columns over the factor limit of 6: no right factor), tall (7 rows over it), a
# square one (its factors have its shape, and are replicated all the same), a 1-D tensor
# (its view [1, 5]), one whose second shard is empty, a replicated matrix, and another of
# the first's shape.
LAYOUTS = [
    ((6, 11), Shard(0)),
    ((7, 5), Shard(0)),
    ((5, 5), Shard(0)),
    ((5,), Shard(0)),
    ((1, 6), Shard(0)),
    ((3, 4), Replicate()),
    ((6, 11), Shard(0)),
]
# each sharded parameter to the rank owning the fewest elements so far (66, 35, 25, 5, 6,
# 66 elements), which alone holds its states; the other rank holds the marker
OWNERS = [0, 1, 1, 1, 1, None, 0]


@functools.cache
def optimizer_class(name):
    return fuser.compile(RULES[name], **OPTIONS.get(name, {}))


def make(name, params):
    return optimizer_class(name)(params, max_matrix_dim=6, **HYPER[name])


def worker(rank, world, name, path, whole_sd):
    held = "momentum_buffer" if name == "kron_diagonal" else "m"
    return precond_ranks.worker(rank, world, functools.partial(make, name), LAYOUTS, held, path, whole_sd)


@pytest.mark.parametrize("name", list(RULES))
def test_row_shards_follow_the_optimizer_on_whole_tensors(tmp_path, name):
    path = str(tmp_path / "dcp")
    sd, params, then = precond_ranks.single_process(functools.partial(make, name), LAYOUTS)
    ranks = run_ranks(worker, name, path, sd)
    for rank, got in enumerate(ranks):
        assert got["holds"] == [o in (None, rank) for o in OWNERS], (rank, got["holds"])
        assert got["marks"] == [None if o in (None, rank) else o for o in OWNERS], (rank, got["marks"])

    def kind_of(key, value, p):
        return "DTensor" if key in ELEMENT_STATES[name] else "Tensor"

    precond_ranks.assert_ranks_follow(ranks, name, LAYOUTS, sd, params, then, kind_of)
    precond_ranks.load_checkpoint_into_one_process(
        functools.partial(make, name), LAYOUTS, name, path, sd, params, then
    )


def refused_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    columns, uneven = precond_ranks.refused_layouts(rank, mesh)

    def batched():
        return distribute_tensor(torch.randn(4, 3, 5), mesh, [Shard(0)])

    return [
        precond_ranks.refusal(make_tensor, lambda p, view=view: make("soap", [dict(params=[p], view=view)]))
        for make_tensor, view in ((columns, "flatten"), (uneven, "flatten"), (batched, "batched"))
    ]


def test_layouts_other_than_row_shards_are_refused_before_any_change():
    for columns, uneven, batched in run_ranks(refused_worker):
        assert columns is not None and "shard it by rows" in columns[0], columns
        assert "Shard(0)" in columns[0] and "Soap" in columns[0], columns
        assert uneven is not None and "torch.chunk's split" in uneven[0], uneven
        assert batched is not None and "batched views of sharded tensors" in batched[0], batched
        assert "Soap" in batched[0], batched
        for refused in (columns, uneven, batched):
            assert refused[1:] == (True, 0), refused


# One parameter, owned by rank 0: rank 1 steps nothing but the exchanges, so it must learn
# of a refused step before them. Its third gradient (a refresh of PL) holds a NaN.
FAILING = [((6, 4), Shard(0))]


def failing_data():
    full, grads = data(FAILING, 3, 2468)
    grads[2][0][1, 2] = float("nan")
    return full, grads


def _snapshot(opt, params) -> tuple:
    sd = opt.state_dict()
    return [p.to_local().clone() for p in params], {
        pid: {k: local_value(v) for k, v in st.items()} for pid, st in sd["state"].items()
    }


def _bad_inputs(opt, params, mesh) -> list:
    """A step with a non-finite learning rate, then one with a float64 gradient: each
    error, and whether the parameters and published states stayed as they were."""
    out = []
    before = _snapshot(opt, params)
    for bad in ("lr", "dtype"):
        saved = [p.grad for p in params]
        if bad == "lr":
            opt.param_groups[0]["lr"] = float("nan")
        else:
            params[0].grad_dtype = None  # (torch refuses a gradient of another dtype otherwise)
            params[0].grad = distribute_tensor(
                torch.ones(params[0].shape, dtype=torch.float64), mesh, [Shard(0)]
            )
        try:
            opt.step()
            out.append(None)
        except (ValueError, RuntimeError) as e:
            out.append((type(e).__name__, str(e), _same(_snapshot(opt, params), before)))
        opt.param_groups[0]["lr"] = HYPER["rowed"]["lr"]
        for p, g in zip(params, saved):
            p.grad = g
    return out


def _same(a, b) -> bool:
    """Whether two snapshots (nested lists and dicts of tensors) hold equal tensors."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def failing_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full, grads = failing_data()
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [pl])) for t, (_, pl) in zip(full, FAILING)]
    opt = make("rowed", params)
    refused = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, step_grads in enumerate(grads):
            for p, g, (_, pl) in zip(params, step_grads, FAILING):
                p.grad = distribute_tensor(g, mesh, [pl])
            if k == 1:
                refused = _bad_inputs(opt, params, mesh)
            opt.step()
    params_now, states = _snapshot(opt, params)
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return dict(params=params_now, states=states, refused=refused, warned=warned)


def test_a_failed_root_or_bad_input_changes_what_one_process_does():
    """A step refused for its input changes nothing on either rank; a root that fails in
    fp32 and fp64 keeps its state's previous value on its owner, which alone warns, and
    every rank ends where one process ends (NaNs included)."""
    full, grads = failing_data()
    params = [torch.nn.Parameter(t.clone()) for t in full]
    opt = make("rowed", params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            if k == 2:
                kept = opt.state[params[0]]["PL"].clone()
            one_thread(opt.step)
    assert torch.equal(opt.state[params[0]]["PL"], kept)
    assert any("keeps its previous value" in str(w.message) for w in caught)
    sd = opt.state_dict()["state"]
    ranks = run_ranks(failing_worker)
    for rank, got in enumerate(ranks):
        lr, dtype = got["refused"]
        assert lr is not None and lr[0] == "ValueError" and "'lr'" in lr[1] and lr[2], (rank, lr)
        assert dtype is not None and "float64" in dtype[1] and dtype[2], (rank, dtype)
        # the NaN's parameter is rank 0's, its root fails there only
        root_failed = any("inv_root()" in w and "keeps its previous value" in w for w in got["warned"])
        assert root_failed == (rank == 0), (rank, got["warned"])
        for i, (p, (_, pl)) in enumerate(zip(params, FAILING)):
            want = rows_of(p.detach(), pl, rank, len(ranks))
            torch.testing.assert_close(got["params"][i], want, rtol=0, atol=0, equal_nan=True)
            assert got["states"][i].keys() == sd[i].keys()
            for key, value in sd[i].items():
                value = rows_of(value, pl, rank, len(ranks)) if key in ELEMENT_STATES["rowed"] else value
                torch.testing.assert_close(got["states"][i][key], value, rtol=0, atol=0, equal_nan=True)


def owner_fails_worker(rank, world, which):
    """A step whose matrix work raises on the owner of the only parameter (rank 0): what
    each rank saw, and whether the next step (the work mended) runs on both."""
    from torch.distributed.device_mesh import init_device_mesh

    from fuser.optim import matrix_rules

    mesh = init_device_mesh("cpu", (world,))
    full, grads = data(FAILING, 2, 1357)
    params = [torch.nn.Parameter(distribute_tensor(full[0], mesh, [Shard(0)]))]
    owner, name, opt = {
        "rule": lambda: (matrix_rules._Batch, "run", make("rowed", params)),
        "SOAP": lambda: (fuser.optim.SOAP, "_adam", fuser.optim.SOAP(params, precondition_frequency=1)),
        "Shampoo": lambda: (fuser.optim.Shampoo, "_directions", fuser.optim.Shampoo(params)),
    }[which]()
    params[0].grad = distribute_tensor(grads[0][0], mesh, [Shard(0)])
    if which == "SOAP":  # (its first step only makes the factors: fail the second)
        opt.step()
    before = params[0].to_local().clone()
    kept = getattr(owner, name)

    def planted(*args, **kwargs):
        if rank == 0:  # (the owner's work; the other rank's, of no parameter, as it is)
            raise RuntimeError("planted failure of the matrix work")
        return kept(*args, **kwargs)

    setattr(owner, name, planted)
    try:
        opt.step()
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        setattr(owner, name, kept)
    unchanged = torch.equal(params[0].to_local(), before)
    opt.step()  # (both ranks reach the same collectives again)
    return dict(error=error, unchanged=unchanged, moved=not torch.equal(params[0].to_local(), before))


@pytest.mark.parametrize("which", ["rule", "SOAP", "Shampoo"])
def test_a_step_that_fails_on_the_owner_leaves_no_rank_waiting(which):
    """The owner's step raises inside its matrix work: it still sends the (unchanged) rows
    back, so the other rank's step returns, and the next step runs on both."""
    ranks = run_ranks(owner_fails_worker, which, timeout=120.0)
    assert ranks[0]["error"] == "planted failure of the matrix work" and ranks[1]["error"] is None
    assert all(r["unchanged"] and r["moved"] for r in ranks), ranks
