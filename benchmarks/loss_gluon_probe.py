"""Gluon (Triton 3.6) Hopper probe: logits matmul with a softmax-statistics epilogue off the MMA path.

For x [M, K] bf16 (tokens x hidden) and w [N, K] bf16 (vocab x hidden) each output tile
z = x_tile @ w_tile^T (fp32, wgmma) is reduced per row to ``m = max z`` and
``s = sum exp(z - m)`` over the tile's valid columns, stored in ``part[tile_n, row] = (m, s)``
(fp32, shape [ceil(N / BN), M, 2]). With ``STORE_E`` the kernel also writes
``E = exp(z - ref[row])`` as bf16 into ``e`` [M, N] by TMA.

Variants:

* ``pingpong``: persistent, warp specialised. One producer warp issues TMA loads into a
  shared-memory ring; two consumer warpgroups take alternate tiles of the program's share
  (the default partition tiles 0, 2, 4, ...; a 4-warp worker partition tiles 1, 3, 5, ...).
  A pair of "turn" mbarriers orders their main loops, so one consumer's epilogue runs
  while the other's wgmma K-loop occupies the tensor cores (CUTLASS's ping-pong schedule).
* ``persistent``: not specialised, 4 or 8 warps; async wgmma, loads prefetched across tile
  boundaries so the epilogue of tile i overlaps the loads of tile i+1. ``ctas_per_sm=2``
  lets two programs share an SM so one's epilogue overlaps the other's main loop.

Each variant is checked first (``part`` and ``e`` poisoned with NaN; logsumexp and a sample
of E against an fp32 torch reference), then timed with CUDA events next to cuBLAS
``torch.mm(x, w.t())`` writing bf16 logits. One JSON line per measurement.

Run from the repository root on an H100/H200::

    python benchmarks/loss_gluon_probe.py [gist] [llama8b] [--sweep]
    python benchmarks/loss_gluon_probe.py --compile-only      # no GPU: AOT compile for sm_90

Tunables: ``--bm/--bn/--bk`` (tile of one consumer), ``--stages``, ``--group-m``,
``--consumer-regs``, ``--variants``; the same names upper-cased with prefix ``PROBE_`` in
the environment set the defaults (``PROBE_STAGES=5``).
"""

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, replace

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

LOG2E = gl.constexpr(1.4426950408889634)
E_STUB = (8, 64)  # shape of the unused e tensor and its block when E is not stored
CONFIGS = {"gist": (2304, 768, 128256), "llama8b": (4096, 4096, 128256), "tiny": (300, 256, 1000)}


# --------------------------------------------------------------------------------------------
# Device code shared by the variants
# --------------------------------------------------------------------------------------------


@gluon.constexpr_function
def mma_layout(BM, BN, num_warps):
    """wgmma accumulator layout for a [BM, BN] tile on ``num_warps`` warps (4 or 8)."""
    warps = [num_warps, 1] if BM >= 16 * num_warps else [4, num_warps // 4]
    n = min(BN // warps[1], 256)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.jit
def tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """Grouped order: GROUP_M row blocks sweep the vocabulary together (w stays in L2)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@gluon.jit
def tile_epilogue(acc, pid_m, pid_n, M, N, part_ptr, ref_ptr, e_desc, e_smem, STORE_E: gl.constexpr):
    """Row max and sum of exp over the tile's valid columns -> part; optionally E -> e."""
    BM: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    layout: gl.constexpr = acc.type.layout
    rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    row_ok = rows < M
    # Only z stays live from here on (columns past N are -inf, so they add exp2(-inf) = 0).
    z = gl.where(gl.expand_dims(cols < N, 0), acc, float("-inf"))
    if STORE_E:
        ref = gl.load(ref_ptr + rows, mask=row_ok, other=0.0)
        e = gl.exp2(z * LOG2E - gl.expand_dims(ref * LOG2E, 1)).to(gl.bfloat16)
        tma.store_wait(0)  # the previous tile's E has left e_smem
        e_smem.store(e)
        fence_async_shared()
        tma.async_copy_shared_to_global(e_desc, [pid_m * BM, pid_n * BN], e_smem)
    m = gl.max(z, axis=1)
    s = gl.sum(gl.exp2(z * LOG2E - gl.expand_dims(m * LOG2E, 1)), axis=1)
    dst = part_ptr + (pid_n * M + rows) * 2
    gl.store(dst, m, mask=row_ok)
    gl.store(dst + 1, s, mask=row_ok)


@aggregate
class Problem:
    """Descriptors, pointers and sizes every partition reads."""

    x_desc: tma.tensor_descriptor
    w_desc: tma.tensor_descriptor
    e_desc: tma.tensor_descriptor
    part_ptr: gl.tensor
    ref_ptr: gl.tensor
    M: gl.tensor
    N: gl.tensor
    K: gl.tensor
    GROUP_M: gl.constexpr
    STORE_E: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, x_desc, w_desc, e_desc, part_ptr, ref_ptr, M, N, K, GROUP_M, STORE_E):
        self.x_desc = x_desc
        self.w_desc = w_desc
        self.e_desc = e_desc
        self.part_ptr = part_ptr
        self.ref_ptr = ref_ptr
        self.M = M
        self.N = N
        self.K = K
        self.GROUP_M = gl.constexpr(GROUP_M)
        self.STORE_E = gl.constexpr(STORE_E)

    @gluon.jit
    def grid_shape(self):
        """(row blocks, column blocks, K steps, this program's tile count)."""
        BM: gl.constexpr = self.x_desc.block_type.shape[0]
        BK: gl.constexpr = self.x_desc.block_type.shape[1]
        BN: gl.constexpr = self.w_desc.block_type.shape[0]
        num_m = gl.cdiv(self.M, BM)
        num_n = gl.cdiv(self.N, BN)
        k_tiles = gl.cdiv(self.K, BK)
        my_tiles = gl.cdiv(num_m * num_n - gl.program_id(0), gl.num_programs(0))
        return num_m, num_n, k_tiles, my_tiles

    @gluon.jit
    def tile(self, i, num_m, num_n):
        """(pid_m, pid_n) of this program's i-th tile (tiles are dealt round-robin)."""
        return tile_coords(gl.program_id(0) + i * gl.num_programs(0), num_m, num_n, self.GROUP_M)


@gluon.jit
def issue_load(p, ring, bar, slot, pid_m, pid_n, k, pred=True):
    """TMA x[pid_m, k] and w[pid_n, k] into ring slot ``slot``, completing on ``bar``."""
    x_bufs, w_bufs = ring
    BM: gl.constexpr = p.x_desc.block_type.shape[0]
    BK: gl.constexpr = p.x_desc.block_type.shape[1]
    BN: gl.constexpr = p.w_desc.block_type.shape[0]
    mbarrier.expect(bar, p.x_desc.block_type.nbytes + p.w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(p.x_desc, [pid_m * BM, k * BK], bar, x_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(p.w_desc, [pid_n * BN, k * BK], bar, w_bufs.index(slot), pred)


# --------------------------------------------------------------------------------------------
# Variant "pingpong": producer warp + two consumer warpgroups on alternate tiles
# --------------------------------------------------------------------------------------------


@gluon.jit
def pp_producer(p, ring, ready, empty):
    """Walk this program's tiles in order and keep the ring full."""
    STAGES: gl.constexpr = ready.shape[0]
    num_m, num_n, k_tiles, my_tiles = p.grid_shape()
    cnt = 0
    for i in range(my_tiles):
        pid_m, pid_n = p.tile(i, num_m, num_n)
        for k in range(k_tiles):
            slot = cnt % STAGES
            # Fill f of a slot waits for the release of fill f-1 (a fresh barrier passes parity 1).
            mbarrier.wait(empty.index(slot), ((cnt // STAGES) & 1) ^ 1)
            issue_load(p, ring, ready.index(slot), slot, pid_m, pid_n, k)
            cnt += 1


@gluon.jit
def pp_mainloop(ring, ready, empty, acc, cnt, k_tiles, other_turn):
    """K-loop of one tile from ring position ``cnt``; hands the tensor cores over at the end."""
    x_bufs, w_bufs = ring
    STAGES: gl.constexpr = ready.shape[0]
    for k in range(k_tiles):
        slot = cnt % STAGES
        mbarrier.wait(ready.index(slot), (cnt // STAGES) & 1)
        w_t = w_bufs.index(slot).permute((1, 0))
        acc = warpgroup_mma(x_bufs.index(slot), w_t, acc, use_acc=k > 0, is_async=True)
        # At most one wgmma in flight: the previous step's slot is free again.
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), pred=k > 0)
        cnt += 1
    mbarrier.arrive(other_turn)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES))
    return acc


@gluon.jit
def pp_consumer(p, ring, ready, empty, turn, e_bufs, CID: gl.constexpr):
    """Consumer CID (0 or 1): this program's tiles CID, CID+2, ...; main loops alternate."""
    BM: gl.constexpr = p.x_desc.block_type.shape[0]
    BN: gl.constexpr = p.w_desc.block_type.shape[0]
    num_m, num_n, k_tiles, my_tiles = p.grid_shape()
    e_smem = e_bufs.index(CID)
    my_turn = turn.index(CID)
    other_turn = turn.index(1 - CID)
    j = 0
    for i in range(CID, my_tiles, 2):
        pid_m, pid_n = p.tile(i, num_m, num_n)
        # A fresh accumulator per tile: the last one is dead during the epilogue's temporaries.
        acc = gl.zeros([BM, BN], gl.float32, mma_layout(BM, BN, gl.num_warps()))
        # Consumer 0 starts (fresh barrier, parity 1); then each waits for the other's K-loop.
        mbarrier.wait(my_turn, (j & 1) ^ (1 - CID))
        acc = pp_mainloop(ring, ready, empty, acc, i * k_tiles, k_tiles, other_turn)
        tile_epilogue(acc, pid_m, pid_n, p.M, p.N, p.part_ptr, p.ref_ptr, p.e_desc, e_smem, p.STORE_E)
        j += 1
    tma.store_wait(0)


@gluon.jit
def pingpong_kernel(
    x_desc,
    w_desc,
    e_desc,
    part_ptr,
    ref_ptr,
    M,
    N,
    K,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    STORE_E: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    p = Problem(x_desc, w_desc, e_desc, part_ptr, ref_ptr, M, N, K, GROUP_M, STORE_E)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    e_bufs = gl.allocate_shared_memory(e_desc.dtype, [2] + e_desc.block_type.shape, e_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    ring = (x_bufs, w_bufs)
    gl.warp_specialize(
        [
            (pp_consumer, (p, ring, ready, empty, turn, e_bufs, 0)),
            (pp_producer, (p, ring, ready, empty)),
            (pp_consumer, (p, ring, ready, empty, turn, e_bufs, 1)),
        ],
        [1, 4],
        [24, CONSUMER_REGS],
    )


# --------------------------------------------------------------------------------------------
# Variant "persistent": no specialisation, loads run ahead across tile boundaries
# --------------------------------------------------------------------------------------------


@gluon.jit
def flat_load(p, ring, ready, it, num_m, num_n, k_tiles, total):
    """Issue the loads of flattened step ``it`` (tile it // k_tiles, K step it % k_tiles)."""
    STAGES: gl.constexpr = ready.shape[0]
    pid_m, pid_n = p.tile(it // k_tiles, num_m, num_n)
    slot = it % STAGES
    issue_load(p, ring, ready.index(slot), slot, pid_m, pid_n, it % k_tiles, pred=it < total)


@gluon.jit
def persistent_kernel(
    x_desc,
    w_desc,
    e_desc,
    part_ptr,
    ref_ptr,
    M,
    N,
    K,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    STORE_E: gl.constexpr,
):
    p = Problem(x_desc, w_desc, e_desc, part_ptr, ref_ptr, M, N, K, GROUP_M, STORE_E)
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    e_smem = gl.allocate_shared_memory(e_desc.dtype, e_desc.block_type.shape, e_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    ring = (x_bufs, w_bufs)
    num_m, num_n, k_tiles, my_tiles = p.grid_shape()
    total = my_tiles * k_tiles
    for it in gl.static_range(STAGES - 1):
        flat_load(p, ring, ready, it, num_m, num_n, k_tiles, total)
    it = 0
    for i in range(my_tiles):
        acc = gl.zeros([BM, BN], gl.float32, mma_layout(BM, BN, gl.num_warps()))
        for k in range(k_tiles):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            acc = warpgroup_mma(
                x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, use_acc=k > 0, is_async=True
            )
            acc = warpgroup_mma_wait(1, deps=(acc,))
            # Step it-1's wgmma is done, so its slot takes the loads of step it + STAGES - 1,
            # which run into the next tile: they overlap this tile's epilogue.
            flat_load(p, ring, ready, it + STAGES - 1, num_m, num_n, k_tiles, total)
            it += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        pid_m, pid_n = p.tile(i, num_m, num_n)
        tile_epilogue(acc, pid_m, pid_n, M, N, part_ptr, ref_ptr, e_desc, e_smem, STORE_E)
    tma.store_wait(0)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    kind: str  # "pingpong" or "persistent"
    bm: int = 128
    bn: int = 128
    bk: int = 64
    stages: int = 4
    group_m: int = 16
    store_e: bool = False
    num_warps: int = 4  # persistent: warps of the program; pingpong: warps per consumer
    consumer_regs: int = 232
    maxnreg: int = 168  # pingpong: 12 warps (3 warpgroups incl. the padded producer) share 64K
    ctas_per_sm: int = 1

    @property
    def name(self):
        tail = f"_x{self.ctas_per_sm}" if self.ctas_per_sm > 1 else ""
        w = f"_r{self.consumer_regs}" if self.kind == "pingpong" else f"_w{self.num_warps}"
        return (
            f"{self.kind}_{self.bm}x{self.bn}x{self.bk}_s{self.stages}_g{self.group_m}{w}{tail}"
            f"{'_E' if self.store_e else ''}"
        )

    def kernel(self):
        return pingpong_kernel if self.kind == "pingpong" else persistent_kernel

    def constexprs(self):
        c = {"GROUP_M": self.group_m, "STAGES": self.stages, "STORE_E": self.store_e}
        if self.kind == "pingpong":
            c["CONSUMER_REGS"] = self.consumer_regs
        return c

    def options(self):
        opts = {"num_warps": self.num_warps, "num_stages": 1}
        if self.kind == "pingpong":
            opts["maxnreg"] = self.maxnreg
        return opts

    def block_shapes(self):
        """x, w and e blocks; without E the e staging buffers shrink to a stub."""
        e_block = [self.bm, self.bn] if self.store_e else list(E_STUB)
        return [self.bm, self.bk], [self.bn, self.bk], e_block


def smem_layout(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def make_descs(v: Variant, x, w, e):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return [TensorDescriptor.from_tensor(t, b, smem_layout(b)) for t, b in zip((x, w, e), v.block_shapes())]


def launch(v: Variant, x, w, e, part, ref, num_sms):
    """One call of the kernel; ``e`` is [M, N] bf16 with STORE_E, else a bf16 [8, 64] stub."""
    M, K = x.shape
    N = w.shape[0]
    tiles = triton.cdiv(M, v.bm) * triton.cdiv(N, v.bn)
    grid = (min(num_sms * v.ctas_per_sm, tiles),)
    descs = make_descs(v, x, w, e)
    v.kernel()[grid](*descs, part, ref, M, N, K, **v.constexprs(), **v.options())


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU)
# --------------------------------------------------------------------------------------------


def aot_compile(v: Variant):
    """Compile ``v`` for sm_90 without a GPU; returns Triton's CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(block):
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{smem_layout(block)!r}>"

    x_b, w_b, e_b = v.block_shapes()
    sig = {
        "x_desc": desc(x_b),
        "w_desc": desc(w_b),
        "e_desc": desc(e_b),
        "part_ptr": "*fp32",
        "ref_ptr": "*fp32",
        "M": "i32",
        "N": "i32",
        "K": "i32",
    }
    constexprs = v.constexprs()
    sig.update({name: "constexpr" for name in constexprs})
    src = GluonASTSource(v.kernel(), sig, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=v.options())


def ptx_facts(kernel) -> dict:
    """What the PTX says: wgmma count, setmaxnreg values, .maxnreg, warp-specialised regions."""
    ptx = kernel.asm["ptx"]
    ttgir = kernel.asm["ttgir"]
    return {
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
        "maxnreg": re.findall(r"\.maxnreg\s+(\d+)", ptx),
        "ws_partitions": len(re.findall(r"partition\d+\(", ttgir)),
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx)),
        "tma_stores": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)),
    }


def compile_only(variants) -> int:
    failures = 0
    for v in variants:
        try:
            k = aot_compile(v)
            md = k.metadata
            row = {
                "variant": v.name,
                "shared_bytes": md.shared,
                "num_warps": md.num_warps,
                **ptx_facts(k),
                **ptxas_info(k.asm["ptx"]),
            }
        except Exception as e:  # noqa: BLE001 - report and go on with the next variant
            failures += 1
            row = {"variant": v.name, "error": f"{type(e).__name__}: {str(e).strip()[-2000:]}"}
        print(json.dumps(row), flush=True)
    return failures


def ptxas_info(ptx: str) -> dict:
    """Registers and spills as ptxas reports them for sm_90a (the .maxnreg cap for pingpong)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(90).path, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.findall(r"Used (\d+) registers", out)
    spill = re.findall(r"(\d+) bytes spill stores", out)
    return {
        "ptxas_regs": int(regs[0]) if regs else None,
        "spill_bytes": int(spill[0]) if spill else None,
        "injected_wgmma_waits": len(re.findall(r"warpgroup\.wait is injected", out)),
    }


# --------------------------------------------------------------------------------------------
# GPU: inputs, reference, check, timing
# --------------------------------------------------------------------------------------------


def make_inputs(M, K, N, seed=0):
    """x ~ N(0, 1), w ~ N(0, (2 / sqrt(K))^2): logits of std 2, row maxima near 9."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) * (2.0 / math.sqrt(K))).to(torch.bfloat16)
    return x, w


def reference(x, w, chunk=16384):
    """fp32 row max and logsumexp (float64) of x @ w^T, computed over vocabulary chunks."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    xf = x.float()
    m = torch.full((x.shape[0],), float("-inf"), device=x.device, dtype=torch.float64)
    s = torch.zeros_like(m)
    for n0 in range(0, w.shape[0], chunk):
        z = (xf @ w[n0 : n0 + chunk].float().t()).double()
        m_new = torch.maximum(m, z.max(dim=1).values)
        s = s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(dim=1)
        m = m_new
    return m.float(), m + torch.log(s)


def combine(part):
    """logsumexp per row from the per-tile (max, sum of exp) pairs."""
    import torch

    p = part.double()
    m = p[..., 0].max(dim=0).values
    return m + torch.log((p[..., 1] * torch.exp(p[..., 0] - m)).sum(dim=0))


def buffers(v: Variant, M, N):
    """``part`` and ``e`` poisoned with NaN, so anything the kernel leaves unwritten shows."""
    import torch

    part = torch.full((triton.cdiv(N, v.bn), M, 2), float("nan"), device="cuda")
    shape = (M, N) if v.store_e else E_STUB
    e = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    return part, e


@dataclass
class Problemset:
    """One configuration's inputs and reference, shared by every variant."""

    name: str
    x: object
    w: object
    ref_max: object  # fp32 row max: the ``ref`` input of E
    lse: object  # float64 logsumexp per row

    @staticmethod
    def make(name, M, K, N):
        x, w = make_inputs(M, K, N)
        ref_max, lse = reference(x, w)
        return Problemset(name, x, w, ref_max, lse)


def check(v: Variant, ps: Problemset, num_sms, rows=64) -> dict:
    """Run once against the reference; raises on a wrong answer, returns the errors."""
    import torch

    M, N = ps.x.shape[0], ps.w.shape[0]
    part, e = buffers(v, M, N)
    launch(v, ps.x, ps.w, e, part, ps.ref_max, num_sms)
    torch.cuda.synchronize()
    if not torch.isfinite(part).all():
        raise AssertionError(f"part has {int((~torch.isfinite(part)).sum())} unwritten/NaN entries")
    lse_err = ((combine(part) - ps.lse).abs() / ps.lse.abs().clamp_min(1e-6)).max().item()
    errs = {"lse_rel_err": lse_err}
    if v.store_e:
        if not torch.isfinite(e).all():
            raise AssertionError(f"e has {int((~torch.isfinite(e)).sum())} unwritten/NaN entries")
        idx = torch.randperm(M, device="cuda")[:rows]
        e_ref = torch.exp(ps.x[idx].float() @ ps.w.float().t() - ps.ref_max[idx, None])
        errs["e_rel_err"] = ((e[idx].float() - e_ref).abs() / (e_ref + 1e-30)).max().item()
    if lse_err > 1e-4 or errs.get("e_rel_err", 0.0) > 1e-2:
        raise AssertionError(f"wrong answer: {errs}")
    return errs


def time_ms(fn, warmup=3, reps=10) -> float:
    """Median of ``reps`` CUDA-event timings after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def tflops(M, K, N, ms):
    return 2.0 * M * N * K / (ms * 1e-3) / 1e12


def bench_variant(v: Variant, ps: Problemset, tiny: Problemset, num_sms, reps) -> dict:
    """Check on ``tiny`` (ragged M and N) and on ``ps``, then time: one JSON-ready row."""
    (M, K), N = ps.x.shape, ps.w.shape[0]
    tiny_errs = check(v, tiny, num_sms)
    errs = check(v, ps, num_sms)
    part, e = buffers(v, M, N)
    ms = time_ms(lambda: launch(v, ps.x, ps.w, e, part, ps.ref_max, num_sms), reps=reps)
    return {
        "ms": round(ms, 4),
        "tflops": round(tflops(M, K, N, ms), 1),
        **errs,
        "tiny_lse_rel_err": tiny_errs["lse_rel_err"],
    }


def bench_cublas(ps: Problemset, reps) -> dict:
    import torch

    (M, K), N = ps.x.shape, ps.w.shape[0]
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.mm(ps.x, ps.w.t(), out=out), reps=reps)
    return {"ms": round(ms, 4), "tflops": round(tflops(M, K, N, ms), 1)}


def bench_fuser(ps: Problemset, reps) -> dict:
    """fuser's scaled-schedule kernel (cross-entropy, the tiles ``memory="auto"`` takes on
    sm_90: through descriptors, warp-specialised up to H = 2048) on the same chunk: it also
    reduces each tile's maximum against ``ref``, masks rows without a target and writes the
    partials the schedule combines."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fuser.losses
    from fuser.cache import load_kernel
    from fuser.codegen.loss import shard_layout
    from fuser.codegen.loss_matmul import warp_specialized
    from fuser.ir.loss import lower_loss
    from fuser.runtime.loss.choice import SCALED_TILES_TMA, SCALED_WARP_SPECIALIZED_MAX_HIDDEN
    from fuser.runtime.loss.chunked import logits_buffer

    (M, K), N = ps.x.shape, ps.w.shape[0]
    tiles = SCALED_TILES_TMA
    if K <= SCALED_WARP_SPECIALIZED_MAX_HIDDEN:
        tiles = warp_specialized(tiles)
    tiles = tiles.for_hidden(K)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY)
    kernel = load_kernel(f.scaled_kernel_source("bf16", tiles), ps.x.device)
    layout = shard_layout(lower_loss(fuser.losses.CROSS_ENTROPY, "bf16"))
    red = torch.zeros(M, layout.red_width, device="cuda")
    y = torch.randint(0, N, (M,), device="cuda")
    tn = -(-N // tiles.bn)
    e_buf, part = logits_buffer(M, N, ps.x), torch.empty(tn, M, 2, device="cuda")
    grid = (min(-(-M // tiles.bm) * tn, torch.cuda.get_device_properties(0).multi_processor_count),)
    hyper = torch.zeros(1, device="cuda")
    args = (grid, ps.x, ps.w, ps.w, y, red, ps.ref_max, part, e_buf, e_buf.stride(0), hyper)
    args += (M, K, N, 0, N, -100)
    ms = time_ms(lambda: kernel(*args), reps=reps)
    return {"ms": round(ms, 4), "tflops": round(tflops(M, K, N, ms), 1), "tiles": f"{tiles.bm}x{tiles.bn}"}


def run_config(name, variants, reps, tiny):
    import torch

    M, K, N = CONFIGS[name]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    ps = Problemset.make(name, M, K, N)
    head = {"config": name, "M": M, "K": K, "N": N, "device": torch.cuda.get_device_name(0)}
    print(json.dumps({**head, "variant": "cublas_mm_bf16", **bench_cublas(ps, reps)}), flush=True)
    print(json.dumps({**head, "variant": "fuser_scaled_kernel", **bench_fuser(ps, reps)}), flush=True)
    failed = []
    for v in variants:
        try:
            row = bench_variant(v, ps, tiny, num_sms, reps)
        except Exception as e:  # noqa: BLE001 - report the failure, go on with the next variant
            row = {"status": "FAIL", "error": f"{type(e).__name__}: {str(e).strip()[-1500:]}"}
            failed.append(f"{name}/{v.name}")
        print(json.dumps({**head, "variant": v.name, **row}), flush=True)
        torch.cuda.empty_cache()
    del ps
    torch.cuda.empty_cache()
    return failed


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def env_int(name, default):
    return int(os.environ.get(f"PROBE_{name.upper()}", default))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", help=f"any of {list(CONFIGS)} (default: gist llama8b)")
    ap.add_argument("--compile-only", action="store_true", help="AOT-compile every variant for sm_90")
    ap.add_argument("--sweep", action="store_true", help="add a few more tile/stage settings")
    ap.add_argument("--variants", default=os.environ.get("PROBE_VARIANTS", "pingpong,persistent"))
    ap.add_argument("--bm", type=int, default=env_int("bm", 128))
    ap.add_argument("--bn", type=int, default=env_int("bn", 128))
    ap.add_argument("--bk", type=int, default=env_int("bk", 64))
    ap.add_argument("--stages", type=int, default=env_int("stages", 4))
    ap.add_argument("--group-m", type=int, default=env_int("group_m", 16))
    ap.add_argument("--consumer-regs", type=int, default=env_int("consumer_regs", 232))
    ap.add_argument("--reps", type=int, default=env_int("reps", 10))
    args = ap.parse_args(argv)
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown config(s) {sorted(unknown)}; choose from {list(CONFIGS)}")
    return args


def variant_list(args) -> list:
    """The requested variants, each without and with E; ``--sweep`` adds a few settings."""
    kinds = [k.strip() for k in args.variants.split(",") if k.strip()]
    base = [
        Variant(
            k,
            bm=args.bm,
            bn=args.bn,
            bk=args.bk,
            stages=args.stages,
            group_m=args.group_m,
            consumer_regs=args.consumer_regs,
        )
        for k in kinds
    ]
    if args.sweep:
        extra = {
            "pingpong": [dict(bm=64, bn=256, stages=3), dict(stages=5, group_m=8), dict(consumer_regs=240)],
            "persistent": [dict(stages=2, ctas_per_sm=2), dict(bn=256, num_warps=8, stages=3)],
        }
        base += [replace(b, **kw) for b in base for kw in extra.get(b.kind, [])]
    return [replace(v, store_e=e) for v in base for e in (False, True)]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    variants = variant_list(args)
    if args.compile_only:
        return 1 if compile_only(variants) else 0
    tiny = Problemset.make("tiny", *CONFIGS["tiny"])
    failed = []
    for name in args.configs or ["gist", "llama8b"]:
        failed += run_config(name, variants, args.reps, tiny)
    if failed:
        print(f"FAIL: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
