"""The per-parameter state of a compiled optimizer: checks of what a step is given, the
element states it creates, and the scalar table that per-tensor states live in.

Every function takes the optimizer front end (``fuser.optim.FuserOptimizer``) and reads
its ``rule``, ``options``, ``state`` and ``_state_keys`` (rule state name -> key in
``optimizer.state[p]``).
"""

from __future__ import annotations

import torch

from fuser.ir.optim import COL, ROW, SCALAR, has_matrix_functions, is_tiled, state_kinds
from fuser.runtime import distributed
from fuser.runtime.distributed import local
from fuser.runtime.plans import TORCH_DTYPES, state_dtype
from fuser.runtime.tables import check_layout, view_2d


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
    if is_tiled(opt.rule) or has_matrix_functions(opt.rule):
        _validate_shaped(opt, items)


def _validate_shaped(opt, items) -> None:
    """A rule that reads rows, columns or whole matrices walks each tensor's 2-D view in
    memory order."""
    name = type(opt).__name__
    for p, g, _ in items:
        where = f"parameter of shape {tuple(p.shape)}"
        if distributed.layout(p) is not None:
            raise RuntimeError(
                f"{name} reads rows and columns of its tensors, which a DTensor shard does not "
                f"hold whole ({where}); give it full tensors (e.g. outside FSDP)"
            )
        if not (p.is_contiguous() and g.is_contiguous()):
            raise RuntimeError(
                f"{name} reads rows and columns of its tensors, so a {where} and its "
                f".{opt.options.grad_attr} must be contiguous (call .contiguous() on them)"
            )


def ensure_states(opt, items) -> None:
    """Create each missing element state, and give each one its parameter's device, layout
    and the state dtype; check that per-tensor (scalar) states are one number."""
    init = dict(opt.rule.state)
    kinds = state_kinds(opt.rule)
    for p, _, _ in items:
        st = opt.state[p]
        want = state_dtype(opt.options, p.dtype)
        for s, key in opt._state_keys.items():
            if kinds[s] == SCALAR:
                _check_scalar(key, st.get(key))  # packed into the scalar table by pack_scalars
                continue
            if kinds[s] in (ROW, COL):
                st[key] = _reduced(opt, p, key, kinds[s], st.get(key), init[s], want)
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


def _reduced(opt, p: torch.Tensor, key: str, kind: str, value, init, dtype: torch.dtype) -> torch.Tensor:
    """A state of one number per row (column) of ``p``'s 2-D view: new, or checked and
    moved to the state dtype. Its shape is the front end's ``_reduced_shape(p, kind)``."""
    rows, cols = view_2d(p.shape)
    n = rows if kind == ROW else cols
    if value is None:
        return torch.full(opt._reduced_shape(p, kind), float(init), dtype=dtype, device=p.device)
    if not torch.is_tensor(value):
        raise RuntimeError(f"state {key!r} of a parameter is {type(value).__name__}, not a tensor")
    if value.numel() != n:
        raise RuntimeError(
            f"state {key!r} of a parameter of shape {tuple(p.shape)} holds one number per {kind} "
            f"({n}), but has shape {tuple(value.shape)}"
        )
    if value.dtype != dtype or value.device != p.device or not value.is_contiguous():
        value = value.to(device=p.device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)
    return value


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
