"""Where the lean gradient kernel's and the scaled kernel's time goes beside their products
(H100, bf16, plain cross-entropy, through tensor descriptors, one persistent program per
multiprocessor): each kernel's rendered text against variants edited here (not fuser
options), on the shapes `loss_occupancy.py` times:

- `no store`: the tile's output stored through its descriptor at rows past the end, so
  it is formed and staged in shared memory as before, and nothing reaches memory;
- `no epilogue`: the fp32 tile itself is stored, rounded (no exponential, no masks);
- `int32 target`: (gradient) the target's column compared as a 32-bit offset in the tile
  and the `- [target]` taken by a select, where the rendered text compares 64-bit columns
  and adds a converted comparison;
- `GROUP_M 16`: (gradient) the scaled kernel's grouping.

Each row: the median time (CUDA events), TFLOP/s of the 2*T*H*V product, and the largest
difference of the output from the rendered kernel's (every 97th row; `no store` and `no
epilogue` differ by design).

    python benchmarks/loss_epilogue.py [gist llama8b]
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402
import fuser.losses  # noqa: E402
from fuser.cache import load_kernel  # noqa: E402
from fuser.codegen.loss import shard_layout  # noqa: E402
from fuser.codegen.loss_matmul import WIDE_GRAD_TMA, Tiles  # noqa: E402
from fuser.ir.loss import lower_loss  # noqa: E402
from fuser.runtime.loss.choice import SCALED_TILES_TMA  # noqa: E402
from fuser.runtime.loss.chunked import chunk_rows, logits_buffer  # noqa: E402
from fuser.runtime.loss.fused import slice_cols  # noqa: E402
from fuser.runtime.loss.staged import MAIN_GRAD_BUDGET  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_bench import CONFIGS, warm_up  # noqa: E402
from loss_occupancy import cublas, report  # noqa: E402
from optim_bench import event_ms  # noqa: E402

GRAD_STORE = "            dzd.store([om, on], _to_bf16(d, INTERPRETED))\n"
GRAD_D = "            d = tl.where(valid, g * (-is_y + tl.exp(-r0 + z)), 0.0)\n"
GRAD_IS_Y = "            is_y = (cols == y).to(tl.float32)\n"
SCALED_STORE = "            ed.store([om, on], _to_bf16(ev, INTERPRETED))\n"
SCALED_FIRST = '            a_lse = z + tl.where(lcols < n_cols, 0.0, float("-inf"))\n'
SCALED_LAST = "            ev = u * tl.exp(t_max[:, None] - r_ref)\n"
SCALED_SUM = "            tl.store(out + 0, tl.reduce(u, 1, tl.standard._sum_combine), mask=row_ok)\n"
# the tile's two [BM, BN / 2] halves (Triton's persistent-matmul tutorial's epilogue subtiles)
HALVES = (
    "            z1, z2 = tl.split(tl.permute(tl.reshape(z, (BM, 2, BN // 2)), (0, 2, 1)))\n"
    "            c2 = tl.arange(0, BN // 2)[None, :]\n"
)
GRAD_HALVES = HALVES + (
    "            yo = (y - on - col_offset).to(tl.int32)\n"
    "            e1 = tl.exp(z1 - r0)\n"
    "            d1 = tl.where(valid, g * tl.where(c2 == yo, e1 - 1.0, e1), 0.0)\n"
    "            dzd.store([om, on], _to_bf16(d1, INTERPRETED))\n"
    "            e2 = tl.exp(z2 - r0)\n"
    "            d2 = tl.where(valid, g * tl.where(c2 + BN // 2 == yo, e2 - 1.0, e2), 0.0)\n"
    "            dzd.store([om, on + BN // 2], _to_bf16(d2, INTERPRETED))\n"
)
SCALED_HALVES = HALVES + (
    '            a1 = z1 + tl.where(on + c2 < n_cols, 0.0, float("-inf"))\n'
    '            a2 = z2 + tl.where(on + BN // 2 + c2 < n_cols, 0.0, float("-inf"))\n'
    "            t_max = tl.maximum(tl.max(a1, 1), tl.max(a2, 1))\n"
    '            t_max = tl.where(t_max == float("-inf"), 0.0, t_max)\n'
    "            to_ref = tl.exp(t_max[:, None] - r_ref)\n"
    "            u1 = tl.exp(a1 - t_max[:, None])\n"
    "            ed.store([om, on], _to_bf16(u1 * to_ref, INTERPRETED))\n"
    "            u2 = tl.exp(a2 - t_max[:, None])\n"
    "            ed.store([om, on + BN // 2], _to_bf16(u2 * to_ref, INTERPRETED))\n"
    "            u_sum = tl.sum(u1, 1) + tl.sum(u2, 1)\n"
)
HALF_DESC = ("block_shape=[BM, BN])", "block_shape=[BM, BN // 2])")


def edited(source, *pairs):
    text = source.text
    for old, new in pairs:
        assert text.count(old) == 2, old  # (the interpreter's loop and the compiled one)
        text = text.replace(old, new)
    return dataclasses.replace(source, text=text)


def halves(source, *pairs):
    """`edited`, with the output's descriptor taking [BM, BN / 2] blocks."""
    text = source.text
    assert text.count(HALF_DESC[0]) == 1
    return edited(dataclasses.replace(source, text=text.replace(*HALF_DESC)), *pairs)


def clipped(store: str) -> str:
    """`store` through its descriptor at rows past the tensor's end: the tile is formed and
    staged as before, and the copy out writes nothing."""
    return store.replace("[om, on]", "[om + n_rows, on]")


def grad_variants(source):
    int32 = (
        "            hit = tl.arange(0, BN)[None, :] == (y - on - col_offset).to(tl.int32)\n"
        "            e = tl.exp(z - r0)\n"
        "            d = tl.where(valid, g * tl.where(hit, e - 1.0, e), 0.0)\n"
    )
    variants = (
        ("rendered", source),
        ("no store", edited(source, (GRAD_STORE, clipped(GRAD_STORE)))),
        ("no epilogue", edited(source, (GRAD_D, "            d = z\n"))),
    )
    if GRAD_IS_Y in source.text:  # (fuser's text before it compared 32-bit columns itself)
        variants += (
            ("int32 target", edited(source, (GRAD_IS_Y, ""), (GRAD_D, int32))),
            ("two halves", halves(source, (GRAD_IS_Y, ""), (GRAD_D, ""), (GRAD_STORE, GRAD_HALVES))),
        )
    return (*variants, ("rendered again", source))


def scaled_variants(source):
    text = source.text
    start, end = text.rindex(SCALED_FIRST), text.rindex(SCALED_LAST) + len(SCALED_LAST)
    bare = "            u = z\n            t_max = tl.max(z, 1)\n            ev = z\n"
    body = text[start:end]
    return (
        ("rendered", source),
        ("no store", edited(source, (SCALED_STORE, clipped(SCALED_STORE)))),
        ("no epilogue", edited(source, (body, bare))),
        (
            "two halves",
            halves(
                source,
                (body, SCALED_HALVES),
                (SCALED_STORE, ""),
                (SCALED_SUM, SCALED_SUM.replace("tl.reduce(u, 1, tl.standard._sum_combine)", "u_sum")),
            ),
        ),  # fmt: skip
        ("rendered again", source),
    )


def scaled(cfg, f, x, w, y, sms) -> None:
    t, h, v = CONFIGS[cfg]
    layout = shard_layout(lower_loss(fuser.losses.CROSS_ENTROPY, "bf16"))
    m = min(chunk_rows(t, h, v, 2), t)
    xc, yc = x[:m], y[:m]
    red = torch.zeros(m, layout.red_width, device="cuda")
    hyper = torch.zeros(1, device="cuda")
    ref = (xc[:, :64].float().sum(1) * 0.02).contiguous()
    tiles = SCALED_TILES_TMA.for_hidden(h)
    tn = -(-v // tiles.bn)
    grid = (min(-(-m // tiles.bm) * tn, sms),)
    first = None
    for name, source in scaled_variants(f.scaled_kernel_source("bf16", tiles)):
        kernel = load_kernel(source, x.device)
        e_buf = logits_buffer(m, v, x)
        e_buf.fill_(float("nan"))
        part = torch.empty(tn, m, 2, device="cuda")
        args = (grid, xc, w, w, yc, red, ref, part, e_buf, e_buf.stride(0), hyper, m, h, v, 0, v, -100)
        ms = event_ms(lambda: kernel(*args), warmup=3, rep=10)  # noqa: B023
        sample = e_buf[::97].float()
        first = sample if first is None else first
        diff = ((sample - first).abs().max() / first.abs().max()).item()
        flop = 2 * m * h * v
        report(
            cfg=cfg,
            kernel="scaled",
            variant=name,
            ms=round(ms, 3),
            tflops=round(flop / ms / 1e9, 1),
            diff=diff,
        )
        del e_buf


def gradient(cfg, f, x, w, y, sms) -> None:
    t, h, v = CONFIGS[cfg]
    layout = shard_layout(lower_loss(fuser.losses.CROSS_ENTROPY, "bf16"))
    cols = min(slice_cols(t, h, 2, 256, MAIN_GRAD_BUDGET), v)
    ws = w[:cols]
    red = torch.zeros(t, layout.red_width, device="cuda")
    red[:, 1] = torch.log(torch.tensor(float(v))) + 1.0
    scale = torch.full((1,), 1.0 / t, device="cuda")
    hyper = torch.zeros(1, device="cuda")
    first = None
    for group_m in (8, 16):
        tiles = dataclasses.replace(WIDE_GRAD_TMA, group_m=group_m).for_hidden(h)
        _, grad = f.matmul_kernel_sources("bf16", Tiles().for_hidden(h), grad_tiles=tiles)
        grid = (min(-(-t // tiles.bm) * -(-cols // tiles.bn), sms),)
        variants = grad_variants(grad) if group_m == 8 else (("GROUP_M 16", grad),)
        for name, source in variants:
            kernel = load_kernel(source, x.device)
            dz = logits_buffer(t, cols, x)
            dz.fill_(float("nan"))
            resid = torch.zeros(t, device="cuda")  # (the target column's residue, unread here)
            args = (grid, x, ws, ws, y, red, scale, 0, dz, dz.stride(0), resid, hyper, t, h, cols, 0, v, -100)
            ms = event_ms(lambda: kernel(*args), warmup=3, rep=10)  # noqa: B023
            sample = dz[::97].float()
            first = sample if first is None else first
            diff = ((sample - first).abs().max() / first.abs().max()).item()
            flop = 2 * t * h * cols
            report(
                cfg=cfg, kernel="gradient", variant=name, cols=cols, ms=round(ms, 3),
                tflops=round(flop / ms / 1e9, 1), diff=diff,
            )  # fmt: skip
            del dz


def main(configs) -> None:
    report(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    f = fuser.compile(fuser.losses.CROSS_ENTROPY)
    for cfg in configs:
        t, h, v = CONFIGS[cfg]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        y = torch.randint(0, v, (t,), device="cuda", generator=g)
        warm_up()
        cublas(cfg, x[: min(chunk_rows(t, h, v, 2), t)], w, "cuBLAS mm, scaled chunk, bf16 stored")
        scaled(cfg, f, x, w, y, sms)
        cols = min(slice_cols(t, h, 2, 256, MAIN_GRAD_BUDGET), v)
        cublas(cfg, x, w[:cols], "cuBLAS mm, gradient slice, bf16 stored")
        gradient(cfg, f, x, w, y, sms)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["gist", "llama8b"])
