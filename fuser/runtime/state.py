"""The per-parameter state of a compiled optimizer: checks of what a step is given, the
element states it creates, and the scalar table that per-tensor states live in.

Every function takes the optimizer front end (``fuser.optim.FuserOptimizer``) and reads
its ``rule``, ``options``, ``state`` and ``_state_keys`` (rule state name -> key in
``optimizer.state[p]``).
"""

from __future__ import annotations

import torch

from fuser.codegen.render import quant_block
from fuser.ir.optim import COL, QFORMATS, ROW, SCALAR, has_matrix_functions, is_tiled, state_kinds
from fuser.runtime import distributed, quant
from fuser.runtime.distributed import local
from fuser.runtime.plans import FROM_NAME, MASTER_WEIGHTS, TORCH_DTYPES, state_format
from fuser.runtime.tables import check_layout, is_batched, matrix_2d, n_matrices


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
    if opt.options.master_weights or _quantized_states(opt):
        _validate_compressed(opt, items)


DTYPE_NAMES = tuple(TORCH_DTYPES.values())  # a state's format may depend on its parameter's


def _quantized_states(opt) -> list[str]:
    """The rule's states that some parameter stores in 8 bits."""
    return [
        s
        for s in opt._state_keys
        if any(state_format(opt.options, opt.rule, s, d) in QFORMATS for d in DTYPE_NAMES)
    ]


def _validate_compressed(opt, items) -> None:
    """8-bit states follow their parameter's memory order in blocks (within rows, for a
    rule that reads rows and columns); fp8e4m3 needs a GPU that converts to it; split
    masters sit beside bf16 parameters (fp32 ones are their own masters)."""
    name = type(opt).__name__
    quantized = _quantized_states(opt)
    tiled, block = is_tiled(opt.rule), quant_block()
    e4m3 = [
        s
        for s in quantized
        if any(state_format(opt.options, opt.rule, s, d) == "fp8e4m3" for d in DTYPE_NAMES)
    ]
    old_gpus = set()
    for p, _, gi in items:
        where = f"parameter of shape {tuple(p.shape)}"
        if opt.options.master_weights and p.dtype == torch.float16:
            raise RuntimeError(
                f"{name} keeps split master weights ({opt.options.master_weights}) for bf16 parameters; "
                f"a {where} is float16: store it as bfloat16, or as float32 without master_weights"
            )
        if quantized and not local(p).is_contiguous():
            raise RuntimeError(
                f"{name} stores {', '.join(quantized)} in 8-bit blocks of the parameter's memory order, "
                f"so a {where} must be contiguous (call .contiguous() on it)"
            )
        cols = matrix_2d(local(p).shape, opt._view_of(opt.param_groups[gi]))[1]
        if quantized and tiled and cols % block:
            raise RuntimeError(
                f"{name} reads rows and columns, so it stores {', '.join(quantized)} in 8-bit blocks of "
                f"{block} elements within rows; a {where} has rows of {cols} "
                "elements here, not a multiple of that: store those states as fp32 or bf16 (state_dtype)"
            )
        device = local(p).device
        if e4m3 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            old_gpus.add(torch.cuda.get_device_name(device))
    if old_gpus:
        raise RuntimeError(
            f"{name} stores {', '.join(e4m3)} as fp8e4m3, which this GPU ({', '.join(sorted(old_gpus))}) "
            "cannot convert to (compute capability 8.9 or later: Ada, Hopper); use fp8e5m2 or int8"
        )


def _validate_shaped(opt, items) -> None:
    """A rule that reads rows, columns or whole matrices walks each tensor's 2-D view in
    memory order; a DTensor's shards hold whole rows of it (or split a 1-D tensor's one
    row), and a matrix function gathers a matrix from shards of whole rows."""
    name = type(opt).__name__
    tiled, matrix = is_tiled(opt.rule), has_matrix_functions(opt.rule)
    for p, g, gi in items:
        where = f"parameter of shape {tuple(p.shape)}"
        view = opt._view_of(opt.param_groups[gi])
        if is_batched(p.shape, view):
            _validate_batched(opt, p, view, where)
        if tiled:
            distributed.split_axis(p)
        if matrix:
            distributed.row_shard(p)
        if not (local(p).is_contiguous() and local(g).is_contiguous()):
            raise RuntimeError(
                f"{name} reads rows and columns of its tensors, so a {where} and its "
                f".{opt.options.grad_attr} must be contiguous (call .contiguous() on them)"
            )


def _validate_batched(opt, p: torch.Tensor, view: str, where: str) -> None:
    """A batched view walks each matrix of a plain tensor as a tensor of its own: not yet
    DTensor shards, nor per-tensor scalar states (which each matrix would update on its
    own); 8-bit states where each matrix starts a block (whose rows are whole blocks, for
    a rule that reads rows and columns)."""
    name = type(opt).__name__
    if isinstance(p, distributed.DTensor):
        raise NotImplementedError(
            f"{name} takes a batched 2-D view of a {where}, a DTensor: batched views of sharded "
            "tensors are not supported; use view='flatten' for its param group, or a plain tensor"
        )
    scalars = [s for s, k in state_kinds(opt.rule).items() if k == SCALAR]
    if scalars:
        raise RuntimeError(
            f"{name} takes a batched 2-D view of a {where}, and its rule keeps {scalars} as one "
            "number per tensor, which each matrix would update on its own: use view='flatten'"
        )
    quantized, block = _quantized_states(opt), quant_block()
    rows, cols = matrix_2d(p.shape, view)
    size, what = (cols, "rows") if is_tiled(opt.rule) else (rows * cols, "matrices")
    if quantized and size % block:
        raise RuntimeError(
            f"{name} stores {', '.join(quantized)} in 8-bit blocks of {block} elements, and a batched "
            f"2-D view of a {where} has {what} of {size} elements, not a multiple of that: store "
            "those states as fp32 or bf16 (state_dtype), or use view='flatten'"
        )


def ensure_states(opt, items) -> None:
    """Create each missing element state, and give each one its parameter's device, layout
    and the state dtype; check that per-tensor (scalar) states are one number."""
    init = dict(opt.rule.state)
    kinds = state_kinds(opt.rule)
    for p, _, gi in items:
        st = opt.state[p]
        pdtype = TORCH_DTYPES[p.dtype]
        view = opt._view_of(opt.param_groups[gi])
        if opt.options.master_weights and p.dtype == torch.bfloat16:
            _ensure_master(opt, p, st)
        for s, key in opt._state_keys.items():
            if kinds[s] == SCALAR:
                _check_scalar(key, st.get(key))  # packed into the scalar table by pack_scalars
                continue
            fmt = state_format(opt.options, opt.rule, s, pdtype)
            if fmt in QFORMATS:
                _ensure_quantized(p, st, key, init[s], fmt)
                continue
            want = FROM_NAME[fmt]
            if kinds[s] in (ROW, COL):
                st[key] = _reduced(opt, p, key, kinds[s], st.get(key), init[s], want, view)
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


def _ensure_master(opt, p: torch.Tensor, st) -> None:
    """The low part of ``p``'s split master: zeros when new (the master is ``p``)."""
    dtype = getattr(torch, MASTER_WEIGHTS[opt.options.master_weights])
    lo = st.get("master_lo")
    if lo is None:
        st["master_lo"] = distributed.from_local_like(p, torch.zeros_like(local(p), dtype=dtype))
        return
    if not torch.is_tensor(lo) or lo.shape != p.shape or lo.dtype != dtype:
        found = f"{lo.dtype} of shape {tuple(lo.shape)}" if torch.is_tensor(lo) else type(lo).__name__
        raise RuntimeError(
            f"state 'master_lo' of a parameter of shape {tuple(p.shape)} is {found}; with master_weights="
            f"{opt.options.master_weights!r} it is {dtype} of the parameter's shape"
        )
    if local(lo).device != local(p).device:
        st["master_lo"] = distributed.from_local_like(p, local(lo).to(local(p).device))


def _ensure_quantized(p: torch.Tensor, st, key: str, init, fmt: str) -> None:
    """An 8-bit state of ``p``: its codes under ``key`` and fp32 scales (one per block of
    this rank's elements) under ``key + "_absmax"``. A new state, or one given in floating
    point (loaded, assigned, made by a constructor), is quantized here."""
    block = quant_block()
    lp = local(p)
    value = st.get(key)
    if value is None:
        codes, scales = quant.encode(_initial(lp, init, torch.float32), fmt, block)
        st[key], st[key + "_absmax"] = distributed.from_local_like(p, codes), scales
        return
    if not torch.is_tensor(value):
        raise RuntimeError(f"state {key!r} of a parameter is {type(value).__name__}, not a tensor")
    if not quant.is_codes(value):
        if value.shape != p.shape:
            raise RuntimeError(
                f"state {key!r} of a parameter of shape {tuple(p.shape)} has shape {tuple(value.shape)}"
            )
        codes, scales = quant.encode(local(distributed.like_param(value, p)).to(lp.device), fmt, block)
        st[key], st[key + "_absmax"] = distributed.from_local_like(p, codes), scales
        return
    scales = st.get(key + "_absmax")
    quant.check_compressed(key, local(value), scales, lp, fmt, block)
    if local(value).device != lp.device or scales.device != lp.device or scales.dtype != torch.float32:
        st[key] = distributed.from_local_like(p, local(value).to(lp.device))
        st[key + "_absmax"] = scales.to(device=lp.device, dtype=torch.float32).reshape(-1)


def _reduced(
    opt, p: torch.Tensor, key: str, kind: str, value, init, dtype: torch.dtype, view: str = "flatten"
) -> torch.Tensor:
    """A state of one number per row (column) of each matrix of ``p``'s 2-D view ``view``:
    new, or checked and moved to the state dtype. Its shape is the front end's
    ``_reduced_shape(p, kind, view)``; a DTensor parameter's is a DTensor, sharded like the
    axis it follows (``distributed.reduced_like``)."""
    rows, cols = matrix_2d(p.shape, view)
    n = (rows if kind == ROW else cols) * n_matrices(p.shape, view)
    if value is None:
        return distributed.new_reduced(p, kind, opt._reduced_shape(p, kind, view), float(init), dtype)
    if not torch.is_tensor(value):
        raise RuntimeError(f"state {key!r} of a parameter is {type(value).__name__}, not a tensor")
    if value.numel() != n:
        raise RuntimeError(
            f"state {key!r} of a parameter of shape {tuple(p.shape)} holds one number per {kind} "
            f"of its {view} 2-D view ({n}), but has shape {tuple(value.shape)}"
        )
    value = distributed.reduced_like(p, kind, value)
    here, device = local(value), local(p).device
    if here.dtype != dtype or here.device != device or not here.is_contiguous():
        here = here.to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        value = distributed.with_local(value, here)
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


def dequantized(opt, p: torch.Tensor, st: dict, rule) -> dict:
    """``st`` (a state dict's entry for ``p``, updated by ``rule``) with each 8-bit state
    as fp32 values shaped like ``p``, and no scales."""
    out = dict(st)
    block = quant_block()
    for s, key in opt._state_keys_of(rule).items():
        fmt = state_format(opt.options, rule, s, TORCH_DTYPES.get(p.dtype, "fp32"))
        codes, scales = out.get(key), out.get(key + "_absmax")
        if fmt not in QFORMATS or not quant.is_codes(codes) or scales is None:
            continue
        out[key] = distributed.from_local_like(p, quant.decode(local(codes), scales, fmt, block))
        del out[key + "_absmax"]
    return out


def labelled(opt, p: torch.Tensor, st: dict, rule) -> dict:
    """``st`` as stored, each 8-bit state's format named under ``key + "_format"``; the
    scales of a sharded DTensor's state as ``distributed.scales_like`` lays them out."""
    out = dict(st)
    for s, key in opt._state_keys_of(rule).items():
        fmt = state_format(opt.options, rule, s, TORCH_DTYPES.get(p.dtype, "fp32"))
        if fmt in QFORMATS and key + "_absmax" in out:
            out[key + "_format"] = fmt
            out[key + "_absmax"] = distributed.scales_like(p, out[key + "_absmax"], quant_block())
    return out


def saved_scales(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """This rank's block scales of ``p``'s state from a compressed state dict
    (``distributed.local_scales``: raises for scales saved from another sharding)."""
    return distributed.local_scales(p, value, quant_block())


def check_saved_format(opt, p: torch.Tensor, st: dict, key: str, state: str, rule) -> None:
    """Raise unless saved 8-bit codes of ``state`` are in the format this optimizer
    stores it in."""
    fmt = state_format(opt.options, rule, state, TORCH_DTYPES.get(p.dtype, "fp32"))
    saved = st.get(key + "_format")
    if fmt not in QFORMATS:
        raise RuntimeError(
            f"the state dict holds 8-bit codes of {key!r} (saved with compressed=True), and this optimizer "
            f"stores it as {fmt}: load it into one with the same state_dtype, or save without compressed"
        )
    if saved is not None and saved != fmt:
        raise RuntimeError(
            f"the state dict holds {key!r} in {saved}, and this optimizer stores it in {fmt}: load it into "
            "one with the same state_dtype, or save without compressed"
        )


def quantize_loaded(opt, p: torch.Tensor, key: str, state: str, rule) -> None:
    """A state loaded in floating point, in 8 bits where ``opt`` stores it so."""
    fmt = state_format(opt.options, rule, state, TORCH_DTYPES.get(p.dtype, "fp32"))
    if fmt in QFORMATS:
        opt.state[p].pop(key + "_absmax", None)
        _ensure_quantized(p, opt.state[p], key, 0.0, fmt)
