"""8-bit blockwise states and split master weights, in torch: what ``state_dict()`` and
``load_state_dict()`` use to move between the stored form and fp32. The step's kernels
compute the same formulas in Triton (``templates/helpers.py.jinja``: ``_q8_encode``,
``_q8_decode``, ``_master_join``), with the GPU's fast reciprocal, division and square
root (a few ulp; the rule's own square roots too, beside 8-bit states): their codes can
differ from these by one, next to a rounding boundary only. Both round half to even.

Formats (FlashOptim, Gonzalez Ortiz et al., arXiv:2602.23349, Algorithms 2-3), each over
blocks of ``block`` consecutive elements of a tensor's flat view with scale s:

- ``int8``: s = max|x|, y = 2(x/s) / (1 + |x/s|) (softsign), q = round(127 y);
  x = s * y / (2 - |y|) with y = q / 127, that is s q / (254 - |q|).
- ``uint8``: r = sqrt(max(x, 0)), s = max r, q = round(255 r / s); x = (s q / 255)^2.
- ``int8_linear``: s = max|x|, q = round(127 x / s); x = s q / 127.
- ``uint8_linear``: s = max(max(x, 0)), q = round(255 x / s); x = s q / 255.
- ``fp8e4m3``, ``fp8e5m2``: s = max|x|, q = fp8(M x / s) rounded to nearest, M the
  format's largest finite number (448, 57344); x = s q / M.

In fp32, x / s is x times the block's 1 / s, the linear formats' 127, 255 or M multiplied
into that factor; q / 255 is q times fp32(1 / 255): one division per block, and one
reciprocal per element only for softsign.
"""

from __future__ import annotations

import torch

SIGNED = ("int8", "int8_linear")
FP8_MAX = {"fp8e4m3": 448.0, "fp8e5m2": 57344.0}
CODE_DTYPES = {
    "fp8e4m3": torch.float8_e4m3fn,
    "fp8e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int8_linear": torch.int8,
    "uint8_linear": torch.uint8,
}


# fp32 constants, as the kernels' literals round to them: each product below is one fp32
# multiplication in both.
_INV_127 = torch.tensor(1 / 127, dtype=torch.float32)
_TOP = {"uint8": 255.0, "uint8_linear": 255.0, "int8_linear": 127.0, **FP8_MAX}
_INV_255 = torch.tensor(1 / 255, dtype=torch.float32)


def is_codes(t) -> bool:
    """Whether ``t`` holds a format's codes (not values to quantize)."""
    return torch.is_tensor(t) and t.dtype in CODE_DTYPES.values()


def n_blocks(numel: int, block: int) -> int:
    return max(1, -(-numel // block))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.detach().reshape(-1).float()
    pad = n_blocks(flat.numel(), block) * block - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block)


def encode(x: torch.Tensor, fmt: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes shaped like ``x``, fp32 scales [blocks]) of the values of ``x``."""
    v = _blocks(x, block)
    if fmt == "uint8":
        a = v.clamp(min=0).double().sqrt().float()  # correctly rounded, as the kernel's sqrt_rn
    elif fmt == "uint8_linear":
        a = v.clamp(min=0)
    else:
        a = v.abs()
    s = a.amax(dim=1)
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))[:, None]
    if fmt != "int8":
        inv = inv * _TOP[fmt]  # as the kernel: the code's largest value in the block's factor
    if fmt in FP8_MAX:
        m = FP8_MAX[fmt]
        q = (v * inv).clamp(-m, m).to(CODE_DTYPES[fmt])
        return q.reshape(-1)[: x.numel()].view(x.shape), s
    y = (v if fmt in SIGNED else a) * inv
    if fmt == "int8":
        y = (254 * y) * (1 / (1 + y.abs()))  # 127 * softsign
    if fmt in SIGNED:
        q = torch.round(y).clamp(-127, 127)
    else:
        q = torch.round(y).clamp(max=255)
    codes = q.reshape(-1)[: x.numel()].to(CODE_DTYPES[fmt]).view(x.shape)
    return codes, s


def decode(codes: torch.Tensor, scales: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """fp32 values shaped like ``codes``."""
    c = _blocks(codes, block)
    s = scales.float().reshape(-1, 1)
    if fmt in FP8_MAX:
        x = c * torch.tensor(1 / FP8_MAX[fmt], dtype=torch.float32) * s
    elif fmt == "int8":
        x = c * (1 / (254 - c.abs())) * s  # y / (2 - |y|) for y = c / 127
    elif fmt == "uint8":
        r = c * _INV_255 * s
        x = r * r
    elif fmt == "int8_linear":
        x = c * _INV_127 * s
    else:
        x = c * _INV_255 * s
    return x.reshape(-1)[: codes.numel()].view(codes.shape)


def check_compressed(key: str, codes: torch.Tensor, scales, p: torch.Tensor, fmt: str, block: int) -> None:
    """Raise unless ``codes`` and ``scales`` are a stored ``fmt`` state of ``p``."""
    want = CODE_DTYPES[fmt]
    if codes.dtype != want or codes.shape != p.shape:
        raise RuntimeError(
            f"state {key!r} holds {codes.dtype} of shape {tuple(codes.shape)}; this optimizer stores it "
            f"as {fmt}: {want} of the parameter's shape {tuple(p.shape)}"
        )
    blocks = n_blocks(p.numel(), block)
    if not torch.is_tensor(scales) or scales.numel() != blocks:
        found = tuple(scales.shape) if torch.is_tensor(scales) else type(scales).__name__
        raise RuntimeError(
            f"state {key!r} in {fmt} needs {key + '_absmax'!r}: {blocks} fp32 scales (one per {block} "
            f"elements), not {found}"
        )


def bf16_spacing(p: torch.Tensor) -> torch.Tensor:
    """bf16's spacing at each value of bf16 ``p``, as fp32: 2**(exponent - 7), the
    exponent floored at -100."""
    bits = p.float().view(torch.int32) & 0x7F800000
    return bits.clamp(min=0x0D800000).view(torch.float32) * 2.0**-7


def master_join(p: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 master of bf16 ``p`` and its low part (int8: 2**-8 of p's spacing; int16:
    2**-16)."""
    bits = 8 if lo.dtype == torch.int8 else 16
    return p.float() + lo.float() * (bf16_spacing(p) * 2.0**-bits)
