"""The per-step check: every way a training loop can replace what the kernels read between
steps is seen (against torch.optim.AdamW doing the same), without holding gradients alive;
``static=True`` skips the check and keeps its promises (in-place zero_grad, refresh())."""

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from numerics import Tracked, assert_fp32_close, fp32_close, sqrt
from torch.optim.optimizer import register_optimizer_step_post_hook

import fuser

SHAPES = [(5,), (33, 3), (129,), (7, 2, 3)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


class Shadow:
    """torch's AdamW as its documentation writes it, in float64 with fp32's error bound
    (tests/numerics.py), one step beside each of torch's. Wherever a test gives torch's
    parameter or state other values (new data, a replaced or dropped state), the shadow
    restarts from torch's values, exactly."""

    def __init__(self, ref):
        self.ref, self.values = ref, {}

    def _follow(self, q, name, current):
        kept = self.values.get((q, name))
        if kept is None or kept.value.shape != current.shape or not fp32_close(current, kept):
            kept = Tracked.exact(current)
        return kept

    def step(self, theirs):
        """One step of every parameter of ``theirs`` with a gradient, before torch's."""
        lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
        for q in theirs:
            if q.grad is None:
                continue
            state = self.ref.state.get(q, {})
            p = self._follow(q, "p", q.detach())
            if "exp_avg" in state:
                m = self._follow(q, "m", state["exp_avg"])
                v = self._follow(q, "v", state["exp_avg_sq"])
                t = int(state["step"]) + 1
            else:
                m = v = Tracked.exact(torch.zeros(q.shape, dtype=torch.float64))
                t = 1
            g = Tracked.exact(q.grad)
            p = p * (1 - lr * wd)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            p = p - lr / (1 - b1**t) * (m / (sqrt(v) / (1 - b2**t) ** 0.5 + eps))
            self.values.update({(q, "p"): p, (q, "m"): m, (q, "v"): v})


SHADOWS = weakref.WeakKeyDictionary()


def pair(device, static=False):
    """The same parameters twice: under fuser's AdamW and under torch's."""
    ours = [torch.nn.Parameter(torch.randn(s, device=device)) for s in SHAPES]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return (
        ours,
        fuser.optim.AdamW(ours, static=static, **HYPER),
        theirs,
        torch.optim.AdamW(theirs, foreach=False, **HYPER),
    )


def step_both(ours, opt, theirs, ref, grads=None, in_place=False):
    grads = grads if grads is not None else [torch.randn(p.shape, device=p.device) for p in ours]
    for p, q, g in zip(ours, theirs, grads):
        if g is None:
            p.grad = q.grad = None
        elif in_place and p.grad is not None:
            p.grad.copy_(g)
            q.grad = g.clone()
        else:
            p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    SHADOWS.setdefault(ref, Shadow(ref)).step(theirs)
    ref.step()


def assert_same(ours, opt, theirs, ref):
    """fuser and torch each within fp32's bound of the float64 shadow of torch's steps."""
    shadow = SHADOWS[ref]
    for p, q in zip(ours, theirs):
        if (q, "p") not in shadow.values:
            assert torch.equal(p, q)  # never stepped
            continue
        for who, x in (("fuser", p), ("torch", q)):
            assert_fp32_close(x, shadow.values[(q, "p")], f"{who} parameter")
        if q in ref.state:
            for key, name in (("exp_avg", "m"), ("exp_avg_sq", "v")):
                want = shadow.values[(q, name)]
                assert_fp32_close(opt.state[p][key], want, f"fuser {key}")
                assert_fp32_close(ref.state[q][key], want, f"torch {key}")


def test_new_gradients_every_step_refresh_only_pointers(device):
    ours, opt, theirs, ref = pair(device)
    step_both(ours, opt, theirs, ref)
    before = fuser.stats()
    for _ in range(3):
        step_both(ours, opt, theirs, ref)  # set-to-None style: new gradient objects
    after = fuser.stats()
    assert after["table_builds"] == before["table_builds"]
    assert after["full_checks"] == before["full_checks"]  # no per-parameter Python walk
    assert_same(ours, opt, theirs, ref)


def test_gradients_kept_in_place_reuse_everything(device):
    ours, opt, theirs, ref = pair(device)
    step_both(ours, opt, theirs, ref)
    before, grads = fuser.stats(), [p.grad for p in ours]
    for _ in range(2):
        step_both(ours, opt, theirs, ref, in_place=True)
    assert fuser.stats()["table_builds"] == before["table_builds"]
    assert fuser.stats()["full_checks"] == before["full_checks"]
    assert all(p.grad is g for p, g in zip(ours, grads))
    assert_same(ours, opt, theirs, ref)


def test_a_gradient_with_other_strides_is_seen(device):
    ours, opt, theirs, ref = pair(device)
    step_both(ours, opt, theirs, ref)
    grads = [torch.randn(p.shape, device=device) for p in ours]
    grads[1] = torch.randn(3, 33, device=device).t()
    assert grads[1].stride() != ours[1].stride()
    with pytest.raises(ValueError, match="strides"):  # refused, as before: not misread
        step_both(ours, opt, theirs, ref, grads)


def test_replaced_parameter_storage_is_updated(device):
    ours, opt, theirs, ref = pair(device)
    step_both(ours, opt, theirs, ref)
    fresh = torch.randn(SHAPES[2], device=device)
    ours[2].data, theirs[2].data = fresh.clone(), fresh.clone()
    checks = fuser.stats()["full_checks"]
    step_both(ours, opt, theirs, ref)
    assert fuser.stats()["full_checks"] == checks + 1
    assert_same(ours, opt, theirs, ref)


def test_gradient_appearing_and_disappearing(device):
    ours, opt, theirs, ref = pair(device)
    grads = [torch.randn(p.shape, device=device) for p in ours]
    grads[0] = None
    step_both(ours, opt, theirs, ref, grads)
    step_both(ours, opt, theirs, ref)  # parameter 0 now has a gradient
    grads = [torch.randn(p.shape, device=device) for p in ours]
    grads[3] = None
    step_both(ours, opt, theirs, ref, grads)  # and parameter 3 none
    assert_same(ours, opt, theirs, ref)


def test_replaced_state_tensor_and_param_list_edit(device):
    ours, opt, theirs, ref = pair(device)
    step_both(ours, opt, theirs, ref)
    opt.state[ours[1]]["exp_avg"] = torch.zeros_like(ours[1])
    ref.state[theirs[1]]["exp_avg"] = torch.zeros_like(theirs[1])
    step_both(ours, opt, theirs, ref)
    assert_same(ours, opt, theirs, ref)
    # A parameter swapped into a group's list in place, without add_param_group.
    extra = torch.nn.Parameter(torch.randn(11, device=device))
    extra_ref = torch.nn.Parameter(extra.detach().clone())
    opt.param_groups[0]["params"][0] = extra
    ref.param_groups[0]["params"][0] = extra_ref
    ours[0], theirs[0] = extra, extra_ref
    step_both(ours, opt, theirs, ref)
    assert_same(ours, opt, theirs, ref)


def test_the_check_holds_no_gradient_alive(device):
    ours, opt, theirs, ref = pair(device)
    step_both(ours, opt, theirs, ref)
    watched = weakref.ref(ours[0].grad)
    for p in ours:
        p.grad = None  # as model.zero_grad() does, behind the optimizer's back
    gc.collect()
    assert watched() is None


def test_static_matches_torch_and_zeroes_in_place(device):
    ours, opt, theirs, ref = pair(device, static=True)
    step_both(ours, opt, theirs, ref)
    grads = [p.grad for p in ours]
    builds = fuser.stats()["table_builds"]
    for _ in range(3):
        opt.zero_grad()
        assert all(p.grad is g and not g.any() for p, g in zip(ours, grads))
        step_both(ours, opt, theirs, ref, in_place=True)
    assert fuser.stats()["table_builds"] == builds
    assert_same(ours, opt, theirs, ref)


def test_static_refresh_reads_replaced_tensors(device):
    ours, opt, theirs, ref = pair(device, static=True)
    step_both(ours, opt, theirs, ref)
    step_both(ours, opt, theirs, ref)  # new gradient objects, as promised not to: then
    opt.refresh()  # refresh() says so, and the next step reads them
    fresh = torch.randn(SHAPES[0], device=device)
    ours[0].data, theirs[0].data = fresh.clone(), fresh.clone()
    step_both(ours, opt, theirs, ref)
    # The second step read the first step's gradients: compare from a common point.
    for p, q in zip(ours, theirs):
        q.data.copy_(p.data)
        ref.state[q]["exp_avg"].copy_(opt.state[p]["exp_avg"])
        ref.state[q]["exp_avg_sq"].copy_(opt.state[p]["exp_avg_sq"])
    opt.refresh()
    step_both(ours, opt, theirs, ref)
    assert_same(ours, opt, theirs, ref)


def test_static_must_be_a_bool():
    with pytest.raises(ValueError, match="static must be True or False"):
        fuser.optim.AdamW([torch.nn.Parameter(torch.randn(3))], static="yes")


def test_step_hooks_and_profiler_range_as_torch(device):
    ours, opt, theirs, ref = pair(device)
    seen = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o)))
    post = opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o)))
    glob = register_optimizer_step_post_hook(lambda o, a, k: seen.append(("global", o)))
    try:
        step_both(ours, opt, theirs, ref)
    finally:
        pre.remove(), post.remove(), glob.remove()
    assert seen[:2] == [("pre", opt), ("post", opt)] and ("global", opt) in seen
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step_both(ours, opt, theirs, ref)
    assert any(e.name == "Optimizer.step#AdamW.step" for e in prof.events())
    assert_same(ours, opt, theirs, ref)


def test_state_assignment_is_seen_even_when_static_and_states_pickle_as_dicts(device):
    ours, opt, theirs, ref = pair(device, static=True)
    step_both(ours, opt, theirs, ref, in_place=False)
    opt.zero_grad()
    ref.zero_grad(set_to_none=False)
    opt.state[ours[2]]["exp_avg_sq"] = torch.full_like(ours[2], 0.5)
    ref.state[theirs[2]]["exp_avg_sq"] = torch.full_like(theirs[2], 0.5)
    step_both(ours, opt, theirs, ref, in_place=True)
    assert_same(ours, opt, theirs, ref)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert all(type(st) is dict for st in saved["state"].values())
    assert type(pickle.loads(pickle.dumps(opt.state[ours[2]]))) is dict
    assert torch.equal(saved["state"][2]["exp_avg_sq"], opt.state[ours[2]]["exp_avg_sq"])


def test_a_transposed_view_of_the_same_storage_is_seen(device):
    ours, opt, theirs, ref = pair(device)
    extra = torch.nn.Parameter(torch.randn(5, 5, device=device))
    extra_ref = torch.nn.Parameter(extra.detach().clone())
    opt.add_param_group({"params": [extra]})
    ref.add_param_group({"params": [extra_ref]})
    ours, theirs = ours + [extra], theirs + [extra_ref]
    step_both(ours, opt, theirs, ref)
    ours[-1].data, theirs[-1].data = ours[-1].data.t(), theirs[-1].data.t()  # same storage, new strides
    with pytest.raises(ValueError, match="strides"):  # the kept gradient no longer lines up
        opt.step()
    grads = [torch.empty_like(p).copy_(torch.randn(p.shape, device=device)) for p in ours]
    step_both(ours, opt, theirs, ref, grads)
    assert_same(ours, opt, theirs, ref)


def test_a_main_grad_of_another_dtype_is_seen(device):
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in SHAPES]
    start = [p.detach().clone() for p in params]
    opt = fuser.optim.SGD(params, lr=0.1, grad_attr="main_grad")
    for p in params:
        p.main_grad = torch.randn(p.shape, device=device)
    opt.step()
    first = [p.main_grad.clone() for p in params]
    for p in params:  # same shape and strides, half the bytes per element
        p.main_grad = torch.randn(p.shape, device=device).to(torch.bfloat16)
    opt.step()
    for p, s, g1 in zip(params, start, first):
        want = Tracked.exact(s) - 0.1 * Tracked.exact(g1) - 0.1 * Tracked.exact(p.main_grad)
        assert_fp32_close(p, want, "p")


@pytest.mark.parametrize("static", [False, True])
def test_a_replaced_or_dropped_state_dict_is_seen(device, static):
    ours, opt, theirs, ref = pair(device, static=static)
    step_both(ours, opt, theirs, ref, in_place=static)
    # A parameter's whole state replaced (as by hand from another run), another's dropped
    # (a fresh start for it: its step count and moments begin again).
    half = {k: v * 0.5 if k != "step" else v.clone() for k, v in ref.state[theirs[1]].items()}
    opt.state[ours[1]] = {k: v.clone() for k, v in half.items()}
    ref.state[theirs[1]] = half
    del opt.state[ours[3]]
    del ref.state[theirs[3]]
    step_both(ours, opt, theirs, ref, in_place=static)
    assert_same(ours, opt, theirs, ref)
    # A new table altogether (torch's load_state_dict and __setstate__ assign one).
    opt.state = type(ref.state)(dict, {p: dict(opt.state[p]) for p in ours})
    step_both(ours, opt, theirs, ref, in_place=static)
    assert_same(ours, opt, theirs, ref)


def test_the_state_table_copies_and_pickles_as_torchs(device):
    ours, opt, theirs, ref = pair(device)
    step_both(ours, opt, theirs, ref)
    for copied in (opt.state.copy(), copy.copy(opt.state)):
        assert type(copied) is type(ref.state) and copied.default_factory is dict
        assert set(copied) == set(opt.state)
    deep = copy.deepcopy(opt.state)
    assert type(deep) is type(ref.state) and len(deep) == len(ours)
    for p, q in zip(opt.state.values(), deep.values()):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and p["exp_avg"] is not q["exp_avg"]
    restored = pickle.loads(pickle.dumps(opt.state))
    assert type(restored) is type(ref.state) and len(restored) == len(ours)
    # Reading the entry of a parameter that has none creates it, as torch's table does,
    # and the next step takes the full check.
    extra = torch.nn.Parameter(torch.randn(3, device=device))
    assert opt.state[extra] == {} and extra in opt.state
    before = fuser.stats()["full_checks"]
    step_both(ours, opt, theirs, ref)
    assert fuser.stats()["full_checks"] == before + 1
    step_both(ours, opt, theirs, ref)
    assert fuser.stats()["full_checks"] == before + 1
    assert_same(ours, opt, theirs, ref)
