"""The one chunk layout (functional/chunks.py): both tile orders cover every chunk of every row
exactly once, and row tiles are views of the unchunked tensor except the filled last chunk; the
cumulative sums within chunks."""

import pytest
import torch

from linattn.functional.chunks import ChunkLayout, cumsum_in_chunks


@pytest.mark.parametrize("R,N,C,tile", [(1, 1, 64, 4096), (3, 7, 2, 4), (2, 100, 16, 40), (5, 64, 16, 4096),
                                        (2, 65, 64, 64), (4, 33, 8, 1)])
def test_row_tiles_cover_every_chunk_once_and_are_views_where_unfilled(R, N, C, tile):
    lay = ChunkLayout.by_rows(R, N, C, tile)
    assert lay.rows_per_tile == 1 or lay.per_tile == lay.Nc  # whole rows, or blocks of one row
    x = torch.arange(R * N * 3, dtype=torch.float32).view(R, N, 3)
    seen = torch.zeros(R, N, dtype=torch.int64)
    for rows in lay.row_groups():
        for chunks in lay.blocks():
            block = lay.block(x[rows], chunks)
            pos = lay.positions(chunks)
            r, n = rows.stop - rows.start, pos.stop - pos.start
            assert block.shape == (r * (chunks.stop - chunks.start), lay.C, 3)
            # the block holds the positions in order, then zeros filling the last chunk
            got = block.view(r, -1, 3)
            torch.testing.assert_close(got[:, :n], x[rows, pos])
            assert (got[:, n:] == 0).all()
            assert lay.fills(chunks) == (n % lay.C != 0)
            if not lay.fills(chunks):
                assert block.data_ptr() == x[rows, pos].data_ptr()  # a view: no copy in
                assert lay.target(x[rows], chunks).data_ptr() == block.data_ptr()  # nor out
            else:
                assert lay.target(x[rows], chunks) is None
            seen[rows, pos] += 1
            dst = torch.zeros_like(x)
            lay.put_block(dst[rows], chunks, block)
            torch.testing.assert_close(dst[rows, pos], x[rows, pos])
    assert (seen == 1).all()
    blocks_per_row = len(lay.blocks())
    assert lay.block_starts() == (0 if lay.rows_per_tile > 1 or blocks_per_row == 1 else (blocks_per_row - 1) * R)


@pytest.mark.parametrize("R,N,C,tile", [(3, 7, 2, 4), (2, 100, 16, 40), (1, 5, 64, 1)])
def test_chunk_major_tiles_cover_every_chunk_once(R, N, C, tile):
    lay = ChunkLayout.of(R, N, C, tile_positions=tile)
    x = torch.randn(R, N, 2)
    xc = lay.chunked(x)
    assert xc.shape == (R, lay.Nc, lay.C, 2)
    out = lay.new_chunked(x, 2)
    covered = []
    for sl in lay.tiles():
        part = lay.take(xc, sl)
        assert part.shape == (sl.stop - sl.start, R, lay.C, 2)
        lay.put(out, sl, part)
        covered += range(sl.start, sl.stop)
    assert covered == list(range(lay.Nc))
    torch.testing.assert_close(lay.unchunked(out), x)


def test_take_scaled_is_take_times_its_factor_chunk_major_and_contiguous():
    lay = ChunkLayout.of(3, 10, 4, chunks_per_tile=2)
    xc = lay.chunked(torch.randn(3, 10, 5, dtype=torch.float64))
    per_position = lay.chunked(torch.rand(3, 10, 1, dtype=torch.float64))[..., 0]  # (R, Nc, C)
    for sl in lay.tiles():
        for factor, want in ((0.5, lay.take(xc, sl) * 0.5),
                             (per_position, lay.take(xc, sl) * lay.take(per_position, sl)[..., None])):
            got = lay.take_scaled(xc, sl, factor)
            assert got.is_contiguous() and got.shape == (sl.stop - sl.start, 3, lay.C, 5)
            assert torch.equal(got, want)
            out = torch.empty_like(want)
            assert lay.take_scaled(xc, sl, factor, out) is out and torch.equal(out, want)


def test_of_needs_exactly_one_tile_size():
    with pytest.raises(TypeError, match="exactly one of chunks_per_tile and tile_positions"):
        ChunkLayout.of(2, 10, 4)
    with pytest.raises(TypeError, match="exactly one of chunks_per_tile and tile_positions"):
        ChunkLayout.of(2, 10, 4, chunks_per_tile=1, tile_positions=8)


def test_tile_buffers_reuse_one_buffer_per_name_and_keep_nothing_else_alive():
    import gc
    import weakref

    from linattn.functional.chunks import TileBuffers, release_kept_buffers

    like = torch.zeros(3)
    buf = TileBuffers(like)
    a = buf("x", 4, 5)
    assert a.shape == (4, 5) and a.dtype == like.dtype
    b = buf("x", 2, 3)  # a smaller tile: the same storage
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 3)
    assert buf("y", 2, 3).data_ptr() != a.data_ptr()  # another name, another buffer
    c = buf("x", 5, 5)  # larger: made anew
    assert c.numel() == 25
    release_kept_buffers()
    one = TileBuffers.kept(torch.zeros(2, dtype=torch.float64))
    assert TileBuffers.kept(torch.ones(7, dtype=torch.float64)) is one  # kept per thread and dtype
    assert TileBuffers.kept(torch.ones(7)) is not one
    probe = torch.zeros(5)
    ref = weakref.ref(probe)
    TileBuffers.kept(probe)("z", 3)
    del probe
    gc.collect()
    assert ref() is None  # the kept buffers do not hold the tensor they were made like
    release_kept_buffers()


@pytest.mark.parametrize("N", [12, 10])  # C = 4 divides N, or the last chunk is filled
def test_results_like_an_input_keep_its_layout(N):
    """new_chunked_like / unchunked_like: a result written chunk by chunk comes back with the
    strides of the input it is like (a (B, N, H, D) tensor seen as rows (H, N, D)), holding what
    was written, filled last chunk or not."""
    H, D = 3, 5
    x = torch.randn(1, N, H, D).transpose(1, 2).reshape(H, N, D)  # strides (D, H D, 1): a view
    lay = ChunkLayout.of(H, N, 4, chunks_per_tile=2)
    out = lay.new_chunked_like(x)
    assert out.shape == (H, lay.Nc, 4, D)
    src = lay.chunked(x)
    for tile in lay.tiles():
        lay.put(out, tile, lay.take(src, tile) * 2)
    result = lay.unchunked_like(out, x)
    assert result.stride() == x.stride()
    torch.testing.assert_close(result, x * 2, rtol=0, atol=0)


@pytest.mark.parametrize("C", [1, 2, 7, 16])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("exclusive", [False, True])
def test_cumsum_in_chunks_is_the_running_sum_along_either_dimension(C, reverse, exclusive):
    """Entry t: the sum of the terms at s <= t (from the end: s >= t), t's own left out when
    exclusive; along the last dimension and the one before, as a loop of additions gives it, in float64."""
    x = torch.randn(3, 2, C, 5, generator=torch.Generator().manual_seed(C), dtype=torch.float64)
    want = torch.zeros_like(x)
    for t in range(C):
        for s in range(C):
            if (s > t if reverse else s < t) or (s == t and not exclusive):
                want[:, :, t] += x[:, :, s]
    torch.testing.assert_close(cumsum_in_chunks(x, -2, reverse=reverse, exclusive=exclusive), want, rtol=1e-13,
                               atol=1e-13)
    along_last = cumsum_in_chunks(x.transpose(-1, -2), -1, reverse=reverse, exclusive=exclusive)
    torch.testing.assert_close(along_last, want.transpose(-1, -2), rtol=1e-13, atol=1e-13)


def test_cumsum_in_chunks_names_a_dimension_it_does_not_take():
    with pytest.raises(ValueError, match="cumsum_in_chunks: dim must be -1 or -2, got 0"):
        cumsum_in_chunks(torch.zeros(2, 3), 0)
