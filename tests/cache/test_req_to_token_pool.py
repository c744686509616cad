from __future__ import annotations

import pytest
import torch

from common.cache import PoolInvariantError, ReqToTokenPool


def test_alloc_write_read_free() -> None:
    pool = ReqToTokenPool(max_reqs=3, max_context_len=16)
    assert pool.table.shape == (3, 16) and pool.table.dtype == torch.int64
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(r for r in rows if r is not None) == [0, 1, 2]
    assert pool.alloc() is None and pool.num_free == 0
    row = rows[1]
    assert row is not None
    pool.write(row, 0, [8, 9, 10])
    pool.write(row, 3, torch.tensor([20, 21], dtype=torch.int32))
    assert pool.read(row, 0, 6) == [8, 9, 10, 20, 21, 0]
    assert pool.table[row, :5].tolist() == [8, 9, 10, 20, 21]
    pool.check_integrity()
    pool.free(row)
    assert pool.num_free == 1 and not pool.table[row].any()
    assert pool.alloc() == row
    pool.check_integrity()


def test_double_free_and_bad_rows_raise() -> None:
    pool = ReqToTokenPool(max_reqs=2, max_context_len=4)
    row = pool.alloc()
    assert row is not None
    pool.free(row)
    with pytest.raises(PoolInvariantError, match="double free"):
        pool.free(row)
    with pytest.raises(PoolInvariantError):
        pool.free(7)
    with pytest.raises(PoolInvariantError):
        pool.write(row, 0, [1])  # row is free
    pool.check_integrity()


def test_write_out_of_bounds_raises() -> None:
    pool = ReqToTokenPool(max_reqs=1, max_context_len=4)
    row = pool.alloc()
    assert row is not None
    with pytest.raises(ValueError):
        pool.write(row, 2, [1, 2, 3])
    assert not pool.table.any()


def test_integrity_catches_dirty_free_row() -> None:
    pool = ReqToTokenPool(max_reqs=2, max_context_len=4)
    pool.table[1, 0] = 5  # row 1 is free but holds a slot
    with pytest.raises(PoolInvariantError):
        pool.check_integrity()
