"""Adafactor and CAME against their references: torch.optim.Adafactor and pytorch-optimizer
4.1.0's CAME, each run on float64 copies of the parameters with the same fresh random
gradients; fuser runs in fp32 and must agree to a relative error of 1e-6 on every parameter
and on every state both keep. Checkpoints move between fuser's and torch's Adafactor (and
pytorch-optimizer's CAME) both ways and training continues on the same trajectory."""

import copy

import pytest
import torch

import fuser.optim as fo

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

# Steps of each run against a reference: the first (Adafactor's beta2 is then 0: its states
# are that step's) and two that carry every state over.
STEPS = 3

# Odd sizes: rows and columns of one tile and of several, a tile's corner, 1-D, one element.
# (257 rows, only in the default case: the interpreter's time goes by masked rows. A program
# walks 256 rows, 32 tiles of 8 or slim tiles of 4 or 2: the next strip is one masked row.)
SHAPES = [(7, 13), (29,), (40, 17), (9, 257), (1,)]
RTOL = 1e-6
FP32_EPS = torch.finfo(torch.float32).eps


def rel_err(got, want) -> float:
    got = got.detach().double().cpu().reshape(-1)
    want = want.detach().double().cpu().reshape(-1)
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def pairs(shapes, device, dtype=torch.float32):
    """fuser's parameters (``dtype``) and the reference's float64 copies of them."""
    start = [torch.randn(s) for s in shapes]
    return [p.to(device=device, dtype=dtype) for p in start], [p.clone().double() for p in start]


def train(opt_a, a, opt_b, b, steps, scale=1.0):
    """Both optimizers see the same fresh random gradients (each its own copy)."""
    for _ in range(steps):
        for p, q in zip(a, b):
            g = torch.randn(p.shape, dtype=torch.float64) * scale
            p.grad = g.to(device=p.device, dtype=p.dtype)
            q.grad = g.clone().reshape(q.shape).to(device=q.device, dtype=q.dtype)
        opt_a.step()
        opt_b.step()


def assert_close(ours, theirs, opt, ref, keys, rtol=RTOL):
    """``keys`` maps a state key of ``opt`` to the reference's key, per parameter: 2-D and
    1-D parameters keep different ones."""
    for i, (p, q) in enumerate(zip(ours, theirs)):
        assert rel_err(p, q) <= rtol, f"parameter {i} {tuple(p.shape)}: {rel_err(p, q):.2e}"
        for mine, key in keys(p).items():
            err = rel_err(opt.state[p][mine], ref.state[q][key])
            assert err <= rtol, f"state {mine!r} of parameter {i} {tuple(p.shape)}: {err:.2e}"


def adafactor_keys(p):
    return dict(row_var="row_var", col_var="col_var") if p.dim() >= 2 else dict(col_var="variance")


ADAFACTOR_CASES = {
    "default": dict(shapes=SHAPES + [(257, 17)]),
    "lr-wd": dict(lr=0.05, weight_decay=0.1),
    "maximize-d": dict(lr=0.02, maximize=True, d=1.5, beta2_decay=-0.5),
    "eps-tensor-lr": dict(lr=torch.tensor(0.03), eps=(1e-3, 1e-2), weight_decay=0.05),
}


def torch_kwargs(kw):
    """The float64 reference's keywords: ``eps=(None, ...)`` means fp32's machine epsilon
    for fuser's fp32 parameters, which the reference would take as float64's."""
    eps = kw.get("eps", (None, 1e-3))
    return dict(kw, eps=(FP32_EPS if eps[0] is None else eps[0], eps[1]))


@pytest.mark.sweep(runs=2)  # half the keyword cases a run, all in 2 runs
@pytest.mark.parametrize("case", list(ADAFACTOR_CASES))
def test_adafactor_follows_torch(case, device):
    kw = dict(ADAFACTOR_CASES[case])
    ours, theirs = pairs(kw.pop("shapes", SHAPES), device)
    opt, ref = fo.Adafactor(ours, **kw), torch.optim.Adafactor(theirs, **torch_kwargs(kw))
    train(opt, ours, ref, theirs, STEPS)
    assert_close(ours, theirs, opt, ref, adafactor_keys)
    for p, q in zip(ours, theirs):  # torch's shapes: [rows, 1] and [1, cols], or [n]
        assert {k: v.shape for k, v in ref.state[q].items() if k != "step"} == {
            k: opt.state[p][m].shape for m, k in adafactor_keys(p).items()
        }


# Parameters of every rank: a batch of 3 matrices, a 2 x 3 batch of matrices, a batch of
# one, beside a matrix and a vector (torch factors the last two dimensions of each).
ND_SHAPES = [(3, 5, 7), (2, 3, 5, 4), (1, 6, 3), (29,)]


def test_adafactor_follows_torch_on_tensors_of_every_rank(device):
    kw = dict(lr=0.05, weight_decay=0.1)
    ours, theirs = pairs(ND_SHAPES, device)
    opt, ref = fo.Adafactor(ours, **kw), torch.optim.Adafactor(theirs, **torch_kwargs(kw))
    train(opt, ours, ref, theirs, STEPS)
    assert_close(ours, theirs, opt, ref, adafactor_keys)
    for p, q in zip(ours, theirs):  # torch's shapes: [*lead, rows, 1] and [*lead, 1, cols], or [n]
        assert {k: v.shape for k, v in ref.state[q].items() if k != "step"} == {
            k: opt.state[p][m].shape for m, k in adafactor_keys(p).items()
        }


def test_adafactor_flatten_view_factors_nd_tensors_over_the_first_dimension(device):
    # view="flatten": a (3, 5, 4) tensor is the matrix [3, 20], torch's Adafactor on that matrix;
    # a param group's "view" key overrides the constructor's (torch's view beside it).
    ours, theirs = pairs([(3, 5, 4), (2, 3, 2, 5), (3, 5, 7)], device)
    flat = [q.reshape(q.shape[0], -1) for q in theirs[:2]]
    groups = [dict(params=ours[:2]), dict(params=ours[2:], view="batched")]
    opt = fo.Adafactor(groups, lr=0.05, view="flatten")
    ref = torch.optim.Adafactor(flat + theirs[2:], lr=0.05, eps=(FP32_EPS, 1e-3))
    train(opt, ours, ref, flat + theirs[2:], STEPS)
    assert_close(ours, flat + theirs[2:], opt, ref, adafactor_keys)
    assert opt.state[ours[0]]["row_var"].shape == (3, 1, 1)
    assert opt.state[ours[0]]["col_var"].shape == (1, 5, 4)
    assert opt.state[ours[2]]["row_var"].shape == (3, 5, 1)


def test_adafactor_eps1_none_is_the_parameter_dtype_epsilon(device):
    # bf16 parameters: eps1 = 2**-7, so eps1**2 clamps these small gradients' variance
    # (fp32's epsilon would not), and the step follows torch given bf16's epsilon.
    ours, theirs = pairs([(33, 70), (70,)], device, torch.bfloat16)
    theirs = [q.bfloat16().double() for q in theirs]
    opt = fo.Adafactor(ours, lr=0.05)
    bf16_eps = torch.finfo(torch.bfloat16).eps
    ref = torch.optim.Adafactor(theirs, lr=0.05, eps=(bf16_eps, 1e-3))
    wrong = [q.clone() for q in theirs]
    ref_wrong = torch.optim.Adafactor(wrong, lr=0.05, eps=(FP32_EPS, 1e-3))
    for _ in range(3):
        grads = [torch.randn(p.shape, dtype=torch.float64) * 1e-3 for p in ours]
        for p, q, w, g in zip(ours, theirs, wrong, grads):
            p.grad, q.grad, w.grad = g.to(device=device, dtype=torch.bfloat16), g.clone(), g.clone()
        opt.step(), ref.step(), ref_wrong.step()
        theirs_rounded = [q.bfloat16().double() for q in theirs]
        with torch.no_grad():
            for q, r in zip(theirs, theirs_rounded):
                q.copy_(r)  # the reference stores its parameter in bf16 as fuser does
    for p, q, w in zip(ours, theirs, wrong):
        assert p.dtype == torch.bfloat16 and opt.state[p]["col_var"].dtype == torch.float32
        assert torch.isfinite(p.float()).all()
        assert rel_err(p, q) <= 2**-7
        assert rel_err(p, w) > 4 * 2**-7  # the fp32 epsilon would step elsewhere


@pytest.mark.parametrize("direction", ["fuser-to-torch", "torch-to-fuser"])
def test_adafactor_checkpoints_move_between_fuser_and_torch(direction, device):
    shapes = [(7, 13), (29,), (1,), (40, 17), (3, 5, 7), (2, 3, 5, 4)]
    kw = dict(lr=0.05, weight_decay=0.1, eps=(FP32_EPS, 1e-3))
    ours, theirs = pairs(shapes, device)
    first = fo.Adafactor(ours, **kw) if direction == "fuser-to-torch" else torch.optim.Adafactor(theirs, **kw)
    mine = ours if direction == "fuser-to-torch" else theirs
    for _ in range(2):
        for p in mine:
            p.grad = torch.randn(p.shape, dtype=p.dtype, device=p.device)
        first.step()
    saved = copy.deepcopy(first.state_dict())
    # Both continue from the first optimizer's parameters and state.
    ours = [p.detach().clone().to(device=device, dtype=torch.float32) for p in mine]
    theirs = [p.detach().clone().cpu().double() for p in mine]
    opt, ref = fo.Adafactor(ours, **kw), torch.optim.Adafactor(theirs, **kw)
    opt.load_state_dict(saved)
    ref.load_state_dict(saved)
    mine_saved, ref_saved = opt.state_dict()["state"], ref.state_dict()["state"]
    for i in range(len(shapes)):  # torch's keys and shapes
        assert {k: v.shape for k, v in mine_saved[i].items()} == {k: v.shape for k, v in ref_saved[i].items()}
    train(opt, ours, ref, theirs, 2)  # one from the loaded states, one from those it wrote
    assert_close(ours, theirs, opt, ref, adafactor_keys)
    assert ref.state[theirs[0]]["step"].item() == opt.state[ours[0]]["step"].item() == 4


def test_adafactor_state_dict_round_trip_is_exact(device):
    ours, _ = pairs([(7, 13), (29,), (3, 4, 5)], device)
    opt = fo.Adafactor(ours, lr=0.05)
    grads = [[torch.randn(p.shape, device=device) for p in ours] for _ in range(4)]
    for i, gs in enumerate(grads):
        if i == 2:
            resumed = [p.detach().clone() for p in ours]
            opt_b = fo.Adafactor(resumed, lr=0.05)
            opt_b.load_state_dict(copy.deepcopy(opt.state_dict()))
        for p, g in zip(ours, gs):
            p.grad = g.clone()
        opt.step()
        if i >= 2:
            for p, g in zip(resumed, gs):
                p.grad = g.clone()
            opt_b.step()
    for p, q in zip(ours, resumed):
        assert torch.equal(p, q)
        for k, v in opt.state[p].items():
            if p.dim() >= 2 or k != "row_var":  # rebuilt: a 1-D tensor's row_var is not read
                assert torch.equal(opt_b.state[q][k], v), k


def test_adafactor_refuses_another_factoring_with_the_sizes(device):
    # torch's state of a (3, 5, 4) tensor factors its last two dimensions; the flatten view does not.
    p = torch.nn.Parameter(torch.randn(3, 5, 4, dtype=torch.float64))
    ref = torch.optim.Adafactor([p])
    p.grad = torch.randn_like(p)
    ref.step()
    mine = torch.randn(3, 5, 4, device=device)
    opt = fo.Adafactor([mine], view="flatten")
    opt.load_state_dict(ref.state_dict())
    mine.grad = torch.randn_like(mine)
    before = mine.clone()
    with pytest.raises(RuntimeError, match="one number per row of its flatten 2-D view"):
        opt.step()
    assert torch.equal(mine, before)


@pytest.mark.parametrize(
    "kw",
    [
        dict(lr=-1e-2),
        dict(lr=torch.tensor([1e-2, 1e-2])),
        dict(beta2_decay=0.5),
        dict(eps=(-1.0, 1e-3)),
        dict(eps=(None, -1e-3)),
        dict(d=0.5),
        dict(weight_decay=-0.1),
    ],
)
def test_adafactor_misuse_raises_torchs_errors(kw):
    with pytest.raises(ValueError) as theirs:
        torch.optim.Adafactor([torch.nn.Parameter(torch.randn(3))], **kw)
    with pytest.raises(ValueError) as ours:
        fo.Adafactor([torch.nn.Parameter(torch.randn(3))], **kw)
    assert str(ours.value) == str(theirs.value)


# --- CAME ------------------------------------------------------------------------------------

CAME_SHAPES = [(7, 13), (29,), (40, 17), (9, 257)]
CAME_CASES = {
    "default-lr": dict(lr=1e-2),
    "decoupled-wd-maximize-clip": dict(
        lr=0.05, weight_decay=0.1, maximize=True, clip_threshold=0.5, betas=(0.8, 0.9, 0.95)
    ),
    "l2-ams-bound": dict(lr=1e-2, weight_decay=0.1, weight_decouple=False, ams_bound=True),
    "fixed-decay-eps": dict(lr=1e-2, weight_decay=0.01, fixed_decay=True, eps1=1e-3, eps2=1e-4),
}


def came_keys(p):
    keys = ["exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col"]
    return {k: k for k in keys} if p.dim() >= 2 else dict(exp_avg="exp_avg", exp_avg_sq_col="exp_avg_sq")


@pytest.mark.sweep(runs=2)  # half the keyword cases a run, all in 2 runs
@pytest.mark.parametrize("case", list(CAME_CASES))
def test_came_follows_pytorch_optimizer(case, device):
    kw = CAME_CASES[case]
    ours, theirs = pairs(CAME_SHAPES, device)
    opt, ref = fo.CAME(ours, **kw), pytorch_optimizer.CAME(theirs, **kw)
    train(opt, ours, ref, theirs, STEPS)

    def keys(p):
        return came_keys(p) | (dict(exp_avg_sq_hat="exp_avg_sq_hat") if kw.get("ams_bound") else {})

    assert_close(ours, theirs, opt, ref, keys)
    saved = opt.state_dict()["state"]
    for i, q in enumerate(theirs):  # the reference's keys and shapes, less its diagnostic RMS
        assert {k: v.shape for k, v in saved[i].items() if k != "step"} == {
            k: v.shape for k, v in ref.state[q].items() if k != "RMS"
        }


def test_came_follows_pytorch_optimizer_on_tensors_of_every_rank(device):
    # The reference factors the last two dimensions, the leading ones a batch.
    kw = dict(lr=1e-2, weight_decay=0.1, clip_threshold=0.5)
    ours, theirs = pairs(ND_SHAPES, device)
    opt, ref = fo.CAME(ours, **kw), pytorch_optimizer.CAME(theirs, **kw)
    train(opt, ours, ref, theirs, STEPS)
    assert_close(ours, theirs, opt, ref, came_keys)
    saved = opt.state_dict()["state"]
    for i, q in enumerate(theirs):
        assert {k: v.shape for k, v in saved[i].items() if k != "step"} == {
            k: v.shape for k, v in ref.state[q].items() if k != "RMS"
        }


@pytest.mark.parametrize("direction", ["fuser-to-reference", "reference-to-fuser"])
def test_came_checkpoints_move_between_fuser_and_pytorch_optimizer(direction, device):
    kw = dict(lr=1e-2, weight_decay=0.1)
    ours, theirs = pairs([(9, 11), (17,), (3, 5, 7)], device)
    first = fo.CAME(ours, **kw) if direction == "fuser-to-reference" else pytorch_optimizer.CAME(theirs, **kw)
    mine = ours if direction == "fuser-to-reference" else theirs
    for _ in range(2):
        for p in mine:
            p.grad = torch.randn(p.shape, dtype=p.dtype, device=p.device)
        first.step()
    saved = copy.deepcopy(first.state_dict())
    ours = [p.detach().clone().to(device=device, dtype=torch.float32) for p in mine]
    theirs = [p.detach().clone().cpu().double() for p in mine]
    opt, ref = fo.CAME(ours, **kw), pytorch_optimizer.CAME(theirs, **kw)
    opt.load_state_dict(saved)
    ref.load_state_dict(saved)
    train(opt, ours, ref, theirs, 2)  # one from the loaded states, one from those it wrote
    assert_close(ours, theirs, opt, ref, came_keys)


@pytest.mark.parametrize(
    "kw", [dict(lr=-1.0), dict(betas=(1.0, 0.9, 0.9)), dict(betas=(0.9, 0.9, 1.5)), dict(eps1=-1.0)]
)
def test_came_misuse_raises_the_references_messages(kw):
    with pytest.raises(Exception) as theirs:
        pytorch_optimizer.CAME([torch.nn.Parameter(torch.randn(3))], **kw)
    with pytest.raises(ValueError) as ours:
        fo.CAME([torch.nn.Parameter(torch.randn(3))], **kw)
    assert str(ours.value) == str(theirs.value)


def test_bf16_parameters_take_fp32_factored_states(device):
    ours, theirs = pairs([(33, 70), (70,)], device, torch.bfloat16)
    for cls in (fo.Adafactor, fo.CAME):
        params = [p.clone() for p in ours]
        opt = cls(params, lr=1e-2)
        for _ in range(2):  # the second reads the fp32 states the first made
            for p in params:
                p.grad = torch.randn(p.shape, device=device).bfloat16()
            opt.step()
        for p, start in zip(params, ours):
            assert p.dtype == torch.bfloat16 and not torch.equal(p, start)
            assert torch.isfinite(p.float()).all()
            assert all(v.dtype == torch.float32 for v in opt.state[p].values())
