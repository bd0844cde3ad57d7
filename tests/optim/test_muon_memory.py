"""What Muon holds between steps (its states alone: the Newton–Schulz stacks are a
per-step workspace), and the workspace's slices: under any ``FUSER_MATRIX_WORKSPACE``
budget the updates are bit-identical to one slice, and where something combines across
tensors (a global reduction, DTensor collectives) or a random stream is keyed by a
tensor's table row (stochastic rounding) the launch group stays one slice."""

import types

import pytest
import sympy
import torch
from seeds import session_seed

import fuser
import fuser.optim
from fuser.codegen.matrix import INTERPRETER_MATRIX_TILES
from fuser.runtime.engine import KernelStep, MatrixStep, program
from fuser.runtime.matrix import WORKSPACE_ENV, Workspace, plan_slices, stack_bytes, workspace_budget

_LEAVES = (str, bytes, int, float, bool, complex, type(None), type, types.ModuleType, types.FunctionType)
_LEAVES += (types.BuiltinFunctionType, types.MethodType, sympy.Basic, torch.dtype, torch.device)


def reachable_tensors(root) -> dict:
    """Every tensor reachable from ``root`` through containers and object attributes,
    one per storage: (storage address, device) -> (storage bytes, a tensor of it)."""
    seen, found, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            found[(storage.data_ptr(), obj.device)] = (storage.nbytes(), obj)
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        else:
            if isinstance(getattr(obj, "__dict__", None), dict):
                todo.append(obj.__dict__)
            todo += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
    return found


def storages(tensors) -> set:
    return {(t.untyped_storage().data_ptr(), t.device) for t in tensors}


def held_bytes(opt, params) -> tuple[int, int, int]:
    """(bytes of every tensor the optimizer keeps but the parameters and gradients, bytes
    of its states among them, bytes of the largest other one)."""
    held = reachable_tensors(opt)
    for key in storages([t for p in params for t in (p, p.grad) if t is not None]):
        held.pop(key, None)
    states = storages(t for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    mine = [n for key, (n, _) in held.items() if key in states]
    others = [n for key, (n, _) in held.items() if key not in states]
    return sum(mine) + sum(others), sum(mine), max(others)


def test_the_walk_finds_the_engines_tensors():
    p = torch.nn.Parameter(torch.randn(9, 13))
    p.grad = torch.randn(9, 13)
    opt = fuser.optim.Muon([p])
    opt.step()
    found = reachable_tensors(opt)
    ptrs = opt._fuser.launches[0].tables.ptrs
    assert storages([ptrs, opt.state[p]["momentum_buffer"]]) <= set(found)


@pytest.mark.parametrize(
    "dtype, state_dtype, per_param",
    [(torch.float32, None, 4), (torch.bfloat16, None, 4), (torch.bfloat16, "param", 2)],
)
def test_held_bytes_after_a_step_are_the_states(dtype, state_dtype, per_param):
    shapes = [(24, 40), (40, 24), (24, 40), (2, 20, 12), (19, 19)]
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = fuser.optim.Muon(params, state_dtype=state_dtype)
    opt.step()
    n = sum(p.numel() for p in params)
    held, states, largest = held_bytes(opt, params)
    assert states / n == pytest.approx(per_param, abs=0.01)
    # the rest: pointer tables, per-tensor scalars and reductions, about 100 bytes a
    # table row (the smallest matrix's stack would be 2.9 KiB)
    rows = sum(g.tables.n_tensors for g in opt._fuser.launches)
    assert held - states < 256 * rows and largest < 1024, ((held - states) / rows, largest)
    assert all(ws.buffer is None for ws in opt._fuser.workspaces)


MUON = dict(lr=0.02, weight_decay=0.01)


def muon_run(monkeypatch, budget: str, params, grads, two_rules=True, **kw):
    """Muon's steps on copies of ``params``; ``two_rules``: the last tensor in a
    heavy-ball group (a rule, and a step engine, of its own)."""
    monkeypatch.setenv(WORKSPACE_ENV, budget)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    groups = [dict(params=ps[:-1]), dict(params=ps[-1:], lr=0.05, nesterov=False)] if two_rules else ps
    opt = fuser.optim.Muon(groups, **MUON, **kw)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    return ps, opt


def launch_groups(opt) -> list:
    return [g for _, engine in opt._step_engines() for g in engine.launches]


def workspaces(opt) -> list:
    return [w for _, engine in opt._step_engines() for w in engine.workspaces]


def assert_same_run(a, b):
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
        assert torch.equal(oa.state[x]["momentum_buffer"], ob.state[y]["momentum_buffer"])


SHAPES = [(16, 24), (24, 16), (3, 8, 5), (16, 24), (33, 9)]


@pytest.fixture(scope="module")
def whole_run():
    """(params, grads of two steps, the unsliced run on them): fresh draws from the session
    seed, shared by the tests that compare a sliced run against the whole one (each runs
    its own sliced run, on clones, and reads the whole one only)."""
    gen = torch.Generator().manual_seed(session_seed(8642))
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(2)]
    with pytest.MonkeyPatch.context() as monkeypatch:
        return params, grads, muon_run(monkeypatch, "unlimited", params, grads)


def test_slices_under_a_tiny_budget_update_bit_identically(monkeypatch, whole_run):
    """Two steps of two rules (nesterov and heavy-ball groups), one tensor a slice."""
    params, grads, whole = whole_run
    sliced = muon_run(monkeypatch, "1", params, grads)
    assert len(launch_groups(whole[1])) == 2  # one per rule (the nesterov and heavy-ball groups)
    groups = launch_groups(sliced[1])
    assert len(groups) == len(SHAPES)  # a budget below every tensor: one tensor a slice
    # each engine's slices share one workspace, the size of the largest tensor's stacks
    assert [w.nbytes for w in workspaces(sliced[1])] == [
        max(g.workspace_end for g in engine.launches) for _, engine in sliced[1]._step_engines()
    ]
    assert workspaces(sliced[1])[0].nbytes < workspaces(whole[1])[0].nbytes / 3
    assert_same_run(whole, sliced)


def test_slices_of_bf16_batched_views_update_bit_identically(monkeypatch):
    """bf16 parameters and momentum, a 3-D tensor's matrices (batched view) in one slice."""
    params = [torch.randn(s).bfloat16() for s in SHAPES]
    grads = [[torch.randn(s).bfloat16() for s in SHAPES] for _ in range(2)]
    kw = dict(two_rules=False, state_dtype="param", view="batched")
    whole = muon_run(monkeypatch, "unlimited", params, grads, **kw)
    sliced = muon_run(monkeypatch, "1", params, grads, **kw)
    assert [g.tables.n_tensors for g in launch_groups(sliced[1])] == [3, 1, 1, 1, 1]  # (3, 8, 5): 3 rows
    assert_same_run(whole, sliced)


def test_slices_keep_tensors_of_a_shape_together():
    shapes = [[(16, 24)], [(24, 16)], [(16, 24)], [(9, 33)], [(16, 24)], [(2, 2)] * 3]
    two = stack_bytes(2, 16, 24, INTERPRETER_MATRIX_TILES.bm)  # two (16, 24) matrices' stacks
    assert plan_slices(shapes, two, "cpu") == [[5], [3], [0, 2], [4], [1]]
    # a tensor's matrices are never apart; where all fit, one slice in the tensors' order
    assert plan_slices(shapes, 0, "cpu") == [[5], [3], [0], [2], [4], [1]]
    assert plan_slices(shapes, 1 << 30, "cpu") == plan_slices(shapes, None, "cpu") == [list(range(6))]


def test_a_moving_workspace_rewrites_the_tables(monkeypatch, whole_run):
    """Each step's workspace at a new address, filled with NaN first: the updates are as
    with one address (the tables follow it, and nothing reads what a step did not write).
    The one-address run is the whole one, which the tiny budget's slices equal bit for bit
    (the test above); the moved run keeps that budget, so its five slices share each
    engine's workspace as before."""
    params, grads, still = whole_run
    kept, acquire = [], Workspace.acquire

    def moving(self):
        self.buffer = torch.empty(self.nbytes + 64 * len(kept), dtype=torch.uint8)[64 * len(kept) :]
        self.buffer.view(torch.int16)[: self.nbytes // 2].fill_(-1)  # bf16 NaN, fp32 NaN
        kept.append(self.buffer)
        acquire(self)

    monkeypatch.setattr(Workspace, "acquire", moving)
    moved = muon_run(monkeypatch, "1", params, grads)
    assert len({b.data_ptr() for b in kept}) == len(kept) == 4  # 2 steps of 2 rules' engines
    assert_same_run(still, moved)


def test_a_captured_step_keeps_its_workspace(monkeypatch):
    """Under CUDA-graph capture (here pretended) the workspace stays from then on, at one
    address: a graph replays the addresses it captured."""
    import fuser.runtime.matrix as matrix

    params = [torch.randn(s) for s in SHAPES[:3]]
    grads = [[torch.randn(s) for s in SHAPES[:3]] for _ in range(3)]
    free = muon_run(monkeypatch, "unlimited", params, grads)
    monkeypatch.setattr(matrix, "capturing", lambda device: len(grads_seen) == 2)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = fuser.optim.Muon([dict(params=ps[:-1]), dict(params=ps[-1:], lr=0.05, nesterov=False)], **MUON)
    grads_seen, buffers = [], []
    for gs in grads:
        grads_seen.append(gs)
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
        buffers.append([w.buffer for w in workspaces(opt)])
    assert buffers[0] == [None, None]  # freed after an eager step
    kept = buffers[1]
    assert all(b is not None for b in kept)  # captured: kept, then reused
    assert all(a is b for a, b in zip(buffers[2], kept))
    held, states, _ = held_bytes(opt, ps)
    assert held - states >= sum(b.numel() for b in kept)
    assert_same_run(free, (ps, opt))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", 1 << 30),
        ("1073741824", 1 << 30),
        ("512MiB", 512 << 20),
        ("2GB", 2 * 10**9),
        (" 1.5 gib ", 3 << 29),
        ("0", 0),
        ("unlimited", None),
    ],
)
def test_workspace_budget_reads_sizes(monkeypatch, text, expected):
    monkeypatch.setenv(WORKSPACE_ENV, text)
    assert workspace_budget() == expected


@pytest.mark.parametrize("text", ["lots", "-1", "12 parsecs", "1e9", "GiB", "inf"])
def test_workspace_budget_errors_name_the_variable(monkeypatch, text):
    monkeypatch.setenv(WORKSPACE_ENV, text)
    with pytest.raises(ValueError, match=rf"{WORKSPACE_ENV} must be a size in bytes.*not '{text}'"):
        workspace_budget()
    # at the first step, before any state is made
    p = torch.nn.Parameter(torch.randn(5, 7))
    p.grad = torch.randn(5, 7)
    opt = fuser.optim.Muon([p])
    with pytest.raises(ValueError, match=WORKSPACE_ENV):
        opt.step()
    assert not opt.state[p]


GLOBAL_MUON = fuser.rule(
    """
    m = momentum * m + g
    p = p - lr * orthogonalize(m) / (1 + global_norm(g))
""",
    name="muon_global_norm",
    hyper=dict(lr=0.02, momentum=0.9),
    state=dict(m=0.0),
)


def test_a_global_reduction_keeps_one_slice(monkeypatch):
    cls = fuser.compile(GLOBAL_MUON)
    # One step: the slices are planned at the first step and kept after it, and carrying
    # momentum across slices is test_slices_under_a_tiny_budget_update_bit_identically's
    # (here both runs are one slice, so a second step would run the same launch twice).
    params = [torch.randn(s) for s in SHAPES[:4]]
    grads = [[torch.randn(s) for s in SHAPES[:4]]]
    runs = []
    for budget in ("unlimited", "1"):
        monkeypatch.setenv(WORKSPACE_ENV, budget)
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = cls(ps)
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        assert len(opt._fuser.launches) == 1
        runs.append(ps)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_stochastic_rounding_keeps_one_slice(monkeypatch):
    params = [torch.randn(s).bfloat16() for s in SHAPES]
    grads = [[torch.randn(s).bfloat16() for s in SHAPES]]
    whole = muon_run(monkeypatch, "unlimited", params, grads, stochastic_rounding=True)
    small = muon_run(monkeypatch, "1", params, grads, stochastic_rounding=True)
    assert len(launch_groups(small[1])) == 2
    assert_same_run(whole, small)


def test_dtensors_keep_one_slice(monkeypatch):
    dist = pytest.importorskip("torch.distributed")
    if not (dist.is_available() and dist.is_gloo_available()) or dist.is_initialized():
        pytest.skip("needs gloo and no process group of the session's")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = [torch.randn(s) for s in SHAPES[:3]]
        monkeypatch.setenv(WORKSPACE_ENV, "1")
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
        for p in params:
            p.grad = distribute_tensor(torch.randn(p.shape), mesh, [Shard(0)])
        opt = fuser.optim.Muon(params)
        opt.step()
        assert len(opt._fuser.launches) == 1
        plain = [torch.nn.Parameter(t.clone()) for t in full]
        for p, q in zip(plain, params):
            p.grad = q.grad.full_tensor().clone()
        fuser.optim.Muon(plain).step()
        for p, q in zip(plain, params):
            assert torch.equal(p, q.full_tensor())
    finally:
        dist.destroy_process_group()


class Group:
    def __init__(self, name, n_phases, matrix_phases=()):
        self.kernels = [f"{name}{k}" for k in range(n_phases)]
        self.matrices = [types.SimpleNamespace(name=f"{name}-ns{k}", phase=k) for k in matrix_phases]
        self.combine = None


def test_slices_run_one_after_another():
    a, b = Group("a", 2, matrix_phases=(0,)), Group("b", 2, matrix_phases=(0,))
    names = [s.kernel if isinstance(s, KernelStep) else s.work.name for s in program([a, b], None, True)]
    assert names == ["a0", "a-ns0", "a1", "b0", "b-ns0", "b1"]
    assert all(isinstance(s, (KernelStep, MatrixStep)) for s in program([a, b], None, True))
