"""The suite's shortcut for an interpreted kernel's calls of its own helpers
(``interpreter_calls.py``): in place for the Triton the Makefile pins, and steps through it
bit-identical to Triton's own calls, which patch ``triton.language`` once more each."""

import re
from pathlib import Path

import interpreter_calls
import pytest
import torch
import triton
from triton.runtime import interpreter

import fuser
import fuser.optim


def _pinned_triton() -> str:
    make = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    return re.search(r"^TRITON_VERSION \?= (\S+)$", make, re.M).group(1)


def test_installed_for_the_pinned_triton():
    if triton.__version__ != _pinned_triton():
        pytest.skip(f"Triton {triton.__version__}, not the pinned {_pinned_triton()}: Triton's own calls")
    assert interpreter_calls.call_fingerprint() == interpreter_calls.KNOWN_CALL
    assert interpreter_calls.installed()


def _steps(monkeypatch):
    """Three steps of AdamW with 8-bit states and stochastic rounding on bf16 parameters
    (helpers: the 8-bit codes, bf16 rounding, random bits): the parameters, the states,
    the patches of triton.language made and the launches."""
    patches = []
    patch = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patches.append(fn) or patch(fn))
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in [(37, 5), (300,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
    opt = fuser.optim.AdamW(params, lr=1e-2, state_dtype="q8", stochastic_rounding=True)
    before = fuser.stats()["launches"]
    for _ in range(3):
        opt.step()
    launches = fuser.stats()["launches"] - before
    states = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in params]
    monkeypatch.setattr(interpreter, "_patch_lang", patch)
    return [p.detach().clone() for p in params], states, len(patches), launches


def test_helper_calls_step_bit_identically_without_the_second_patch(monkeypatch):
    if not interpreter_calls.installed():
        pytest.skip("Triton's own calls (test_installed_for_the_pinned_triton)")
    params, states, patches, launches = _steps(monkeypatch)
    interpreter_calls.uninstall()
    try:
        want_params, want_states, want_patches, want_launches = _steps(monkeypatch)
    finally:
        interpreter_calls.install()
    # one patch a launch through the shortcut; Triton's calls patch again in every helper call
    assert launches == want_launches > 0 and patches == launches and want_patches > 10 * launches
    for p, want in zip(params, want_params):
        assert torch.equal(p, want)
    for state, want in zip(states, want_states):
        assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
