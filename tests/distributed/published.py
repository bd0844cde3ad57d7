"""Checks of what optimizers give DTensor parameters sharded by rows (shared by the tests
of the matrix-preconditioned built-ins and of matrix rules, and imported by the ranks):
a rank's rows of a whole tensor, a rank's copy of a state dict's values, and a published
state value against one process's."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard


def rows_of(t: torch.Tensor, pl, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``t`` under placement ``pl`` (torch.chunk's split)."""
    if not isinstance(pl, Shard):
        return t
    chunks = t.chunk(world, dim=0)
    return chunks[rank] if rank < len(chunks) else t[t.shape[0] :]


def local_value(value):
    """This rank's part of a state value (DTensors' local tensors, copied), lists too."""
    if isinstance(value, (list, tuple)):
        return [local_value(v) for v in value]
    if torch.is_tensor(value):
        return (value.to_local() if hasattr(value, "to_local") else value).clone()
    return value


def kinds(value):
    """The type names of a state value (of each item of a list)."""
    if isinstance(value, (list, tuple)):
        return [kinds(v) for v in value]
    return type(value).__name__


def assert_state(got, want, rank, world, pl, what):
    """A published state value against the single process's: this rank's rows of a state
    laid out like the parameter (``pl`` its placement), the whole value of anything else
    (``pl`` None)."""
    if isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want), what
        for g, w in zip(got, want):
            assert_state(g, w, rank, world, None, what)
        return
    if torch.is_tensor(want):
        want = rows_of(want, pl, rank, world) if pl is not None else want
        assert torch.equal(got, want), what
    else:
        assert got == want, what
