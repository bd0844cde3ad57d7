"""The device tables of one launch: every block's row of addresses and its element count,
checked against the tensors' own addresses, and a moved column refreshed in both tables."""

import torch

from fuser.runtime.tables import build_tables

BLOCK = 64


def rows_of(sizes, dtypes=(torch.float32, torch.bfloat16)):
    return [[torch.randn(n).to(d) for d in dtypes] for n in sizes]


def expected(rows):
    """(addresses per slot, element count) of every block, in block order, from the tensors."""
    out = []
    for row in rows:
        n = row[0].numel()
        for start in range(0, max(n, 1), BLOCK):
            addresses = [t.data_ptr() + start * t.element_size() for t in row]
            out.append(addresses + [max(0, min(BLOCK, n - start))])
    return out


def test_every_block_has_its_addresses_and_count():
    sizes = [1, 63, 64, 65, 0, 300, 7]  # partial, exact, empty and multi-block tensors
    rows = rows_of(sizes)
    t = build_tables(rows, [0] * len(rows), BLOCK, torch.device("cpu"))
    assert t.block_ptrs.shape == (t.n_blocks, 3)
    assert t.block_ptrs.tolist() == expected(rows)
    starts = t.block_start.tolist()
    owners = t.block_tensor.tolist()
    assert all(t.block_ptrs[b, 0] == rows[owners[b]][0].data_ptr() + 4 * starts[b] for b in range(t.n_blocks))


def test_a_moved_column_is_refreshed_in_both_tables():
    rows = rows_of([130, 5, 64])
    t = build_tables(rows, [0, 1, 0], BLOCK, torch.device("cpu"))
    for row in rows:
        row[1] = torch.randn(row[0].numel()).to(torch.bfloat16)  # new gradients, new addresses
    t.set_column(1, torch.tensor([row[1].data_ptr() for row in rows], dtype=torch.int64))
    assert t.ptrs[:, 1].tolist() == [row[1].data_ptr() for row in rows]
    assert t.block_ptrs.tolist() == expected(rows)
