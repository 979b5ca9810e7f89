"""row_chunks: how the fused MLP's forward cuts token rows into blocks (CPU)."""

import pytest
import torch

from te_offload_ops.fused.row_chunks import CHUNK_ENV, block_split_sizes, chunk_mib, chunk_rows, expert_row_ranges


def test_the_limit_comes_from_the_environment_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv(CHUNK_ENV, raising=False)
    assert chunk_mib() == 1024
    monkeypatch.setenv(CHUNK_ENV, "0")
    assert chunk_mib() == 0
    for bad in ("-1", "1.5", "lots"):
        monkeypatch.setenv(CHUNK_ENV, bad)
        with pytest.raises(ValueError, match=f"{CHUNK_ENV} must be a whole number of MiB >= 0.*got '{bad}'"):
            chunk_mib()


def test_rows_per_block_are_whole_tiles_within_the_limit(monkeypatch):
    monkeypatch.setenv(CHUNK_ENV, "1024")
    # 196608 tokens x 14336 bf16 = 5.25 GiB: blocks of 1 GiB / 28672 bytes a row = 37449 -> 37376 rows
    assert chunk_rows(196608, 14336, 2) == 37376
    assert chunk_rows(16384, 1856, 2) == 16384  # 58 MiB: one block
    assert chunk_rows(0, 14336, 2) == 1  # no rows: one (empty) block
    monkeypatch.setenv(CHUNK_ENV, "1")
    assert chunk_rows(100000, 14336, 2) == 128  # a row of 28 KiB: at least one tile
    monkeypatch.setenv(CHUNK_ENV, "0")
    assert chunk_rows(196608, 14336, 2) == 196608


def test_block_split_sizes_cut_experts_at_the_block_edges():
    splits = torch.tensor([300, 0, 77, 651, 5])
    starts, ends = expert_row_ranges(splits)
    blocks = [block_split_sizes(starts, ends, a, min(1033, a + 256)) for a in range(0, 1033, 256)]
    assert [b.tolist() for b in blocks] == [[256, 0, 0, 0, 0], [44, 0, 77, 135, 0], [0, 0, 0, 256, 0],
                                            [0, 0, 0, 256, 0], [0, 0, 0, 4, 5]]
    assert torch.equal(torch.stack(blocks).sum(0), splits)
    # bad sizes (their check raises later) never give a block more rows than it has, nor negative ones
    starts, ends = expert_row_ranges(torch.tensor([500, -200, 900]))
    for a in (0, 256, 512, 768):
        sizes = block_split_sizes(starts, ends, a, a + 256)
        assert int(sizes.min()) >= 0 and int(sizes.sum()) <= 256
