"""The per-parameter state of a compiled optimizer: checks of what a step is given, the
element states it creates, and the scalar table that per-tensor states live in.

Every function takes the optimizer front end (``fuser.optim.FuserOptimizer``) and reads
its ``rule``, ``options``, ``state`` and ``_state_keys`` (rule state name -> key in
``optimizer.state[p]``).
"""

from __future__ import annotations

import torch

from fuser.ir.optim import scalar_state_names
from fuser.runtime import distributed
from fuser.runtime.distributed import local
from fuser.runtime.plans import TORCH_DTYPES, state_dtype
from fuser.runtime.tables import check_layout


def validate(opt, items) -> None:
    """Raise on a parameter or gradient no kernel can update (sparse, complex, another
    dtype or device, a gradient laid out unlike its parameter)."""
    name = type(opt).__name__
    attr = opt.options.grad_attr
    for p, g, _ in items:
        where = f"parameter of shape {tuple(p.shape)}"
        distributed.check(p, g, where, attr)
        p, g = local(p), local(g)
        if g.is_sparse or g.layout != torch.strided:
            raise RuntimeError(f"{name} does not support sparse gradients ({where}); use a dense gradient")
        if p.is_complex() or g.is_complex():
            raise RuntimeError(
                f"{name} does not support complex tensors ({where}); "
                "view them as real with torch.view_as_real"
            )
        if p.dtype not in TORCH_DTYPES:
            raise RuntimeError(
                f"{where} is {p.dtype}; fuser updates float32, bfloat16 and float16 parameters"
            )
        if g.dtype not in TORCH_DTYPES:
            raise RuntimeError(
                f"the .{attr} of a {where} is {g.dtype}; expected float32, bfloat16 or float16"
            )
        if p.device.type == "cpu" or p.device.type == "cuda":
            check_layout(f"the .{attr} of a {where}", g, p)
        else:
            raise RuntimeError(
                f"{where} is on {p.device}; fuser runs on CUDA (and on CPU through Triton's interpreter)"
            )


def ensure_states(opt, items) -> None:
    """Create each missing element state, and give each one its parameter's device, layout
    and the state dtype; check that per-tensor (scalar) states are one number."""
    init = dict(opt.rule.state)
    scalar_names = scalar_state_names(opt.rule)
    for p, _, _ in items:
        st = opt.state[p]
        want = state_dtype(opt.options, p.dtype)
        for s, key in opt._state_keys.items():
            if s in scalar_names:
                _check_scalar(key, st.get(key))  # packed into the scalar table by pack_scalars
                continue
            if key not in st:
                st[key] = _initial(p, init[s], want)
            elif not isinstance(st[key], torch.Tensor):
                raise RuntimeError(f"state {key!r} of a parameter is {type(st[key]).__name__}, not a tensor")
            st[key] = distributed.like_param(st[key], p)  # a DTensor parameter's state is sharded like it
            if st[key].shape == p.shape and (
                st[key].dtype != want or st[key].device != p.device or st[key].stride() != p.stride()
            ):
                fixed = torch.empty_like(p, dtype=want, memory_format=torch.preserve_format)
                fixed.copy_(st[key])
                st[key] = fixed
            check_layout(f"state {key!r}", local(st[key]), local(p))


def _check_scalar(key: str, value) -> None:
    if not (
        value is None or isinstance(value, (int, float)) or (torch.is_tensor(value) and value.numel() == 1)
    ):
        raise RuntimeError(
            f"state {key!r} of a parameter must be one number, not a tensor of shape {tuple(value.shape)}"
        )


def _initial(p: torch.Tensor, init, dtype: torch.dtype) -> torch.Tensor:
    """A new element state: a copy of the parameter (``"p"``) or filled with a number."""
    if init == "p":
        return p.detach().to(dtype, copy=True)
    return torch.full_like(p, float(init), dtype=dtype, memory_format=torch.preserve_format)


def pack_scalars(opt, members, scalar_names, device) -> torch.Tensor:
    """One fp32 row per tensor: step, then each per-tensor scalar state; the optimizer's
    state holds views of it, so the kernel's updates are the state."""
    keys = opt._state_keys
    init = dict(opt.rule.state)
    cols = []
    for p, _, _ in members:
        st = opt.state[p]
        vals = [st.get("step", 0.0)]
        vals += [st[keys[s]] if st.get(keys[s]) is not None else float(init[s]) for s in scalar_names]
        cols.append(
            torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(()).to(device) for v in vals])
        )
    scalars = torch.stack(cols)
    for i, (p, _, _) in enumerate(members):
        st = opt.state[p]
        st["step"] = scalars[i, 0]
        for j, s in enumerate(scalar_names):
            st[keys[s]] = scalars[i, j + 1]
    return scalars
