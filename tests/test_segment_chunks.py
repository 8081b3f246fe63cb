"""The segment-id summaries the CUDA kernels skip tiles with (jax_flashattn/_segment_chunks.py):
checked here on the CPU against their definition, computed with numpy loops, and against what
the kernels rely on: every key sharing an id with a query chunk lies in that chunk's span."""
from __future__ import annotations

import numpy as np
import pytest

from jax_flashattn._segment_chunks import CHUNK, segment_chunks


def _runs(ranges, length):
    """[run begin, run end) per chunk: the maximal run of one-id chunks with the chunk's id."""
    def run(c):
        if ranges[c][0] != ranges[c][1]:
            return c * CHUNK, c * CHUNK
        same = lambda o: ranges[o][0] == ranges[o][1] == ranges[c][0]
        a = c
        while a > 0 and same(a - 1):
            a -= 1
        e = c
        while e + 1 < len(ranges) and same(e + 1):
            e += 1
        return a * CHUNK, min((e + 1) * CHUNK, length)
    return [run(c) for c in range(len(ranges))]


def _expected(ids, other):
    L, M = len(ids), len(other)
    chunk_ranges = lambda x: [(x[c:c + CHUNK].min(), x[c:c + CHUNK].max()) for c in range(0, len(x), CHUNK)]
    mine, theirs = chunk_ranges(ids), chunk_ranges(other)
    spans = []
    for lo, hi in mine:
        hits = [c for c, (olo, ohi) in enumerate(theirs) if olo <= hi and ohi >= lo]
        spans.append((hits[0] * CHUNK, min((hits[-1] + 1) * CHUNK, M)) if hits else (M, 0))
    runs, their_runs = _runs(mine, L), _runs(theirs, M)
    rows = []
    for c, (lo, hi) in enumerate(mine):
        begin, end = min(b for b, _ in spans[c:]), max(e for _, e in spans[:c + 1])
        match = (0, 0)
        for k in (begin // CHUNK, begin // CHUNK + 1):
            if lo == hi and k < len(theirs) and theirs[k] == (lo, lo):
                match = their_runs[k]
                break
        rows.append((lo, hi, begin, end) + runs[c] + match)
    return np.array(rows, np.int32)


def _tile_span(summary, x0, count, length):
    """What a kernel tile of positions [x0, x0 + count) reads: [begin(first chunk), end(last))."""
    last = min(x0 + count, length) - 1
    return summary[x0 // CHUNK, 2], summary[last // CHUNK, 3]


@pytest.mark.parametrize("T,S,sorted_ids", [(1, 17, True), (17, 33, True), (255, 100, True),
                                            (64, 64, False), (40, 1000, False)])
def test_summaries_match_their_definition(T, S, sorted_ids):
    rng = np.random.default_rng(T * 1000 + S)
    B = 2
    if sorted_ids:
        q = np.sort(rng.integers(0, 5, (B, T)), axis=1)
        k = np.sort(rng.integers(0, 5, (B, S)), axis=1)
    else:
        q, k = rng.integers(0, 4, (B, T)), rng.integers(2, 7, (B, S))
    qs, ks = (np.asarray(x) for x in segment_chunks(q.astype(np.int32), k.astype(np.int32)))
    assert qs.shape == (B, -(-T // CHUNK), 8) and ks.shape == (B, -(-S // CHUNK), 8)
    for b in range(B):
        np.testing.assert_array_equal(qs[b], _expected(q[b], k[b]))
        np.testing.assert_array_equal(ks[b], _expected(k[b], q[b]))
        # What the kernels rely on: a key outside a tile's span shares no id with the tile.
        for x0, count in [(0, 16), (0, 64), (16, 48), (32, 128), (T - 1, 16)]:
            if not 0 <= x0 < T:
                continue
            begin, end = _tile_span(qs[b], x0, count, T)
            tile_ids = set(q[b, x0:x0 + count].tolist())
            assert all(begin <= j < end for j in range(S) if k[b, j] in tile_ids)
        # And: the keys of a chunk's matching run all hold the chunk's one id.
        for c in range(qs.shape[1]):
            mb, me = qs[b, c, 6:8]
            assert mb == me == 0 or (q[b, c * CHUNK:(c + 1) * CHUNK] == k[b, mb:me, None]).all()


def test_disjoint_segments_give_empty_spans():
    q = np.zeros((1, 20), np.int32)
    k = np.ones((1, 40), np.int32)
    qs, ks = (np.asarray(x) for x in segment_chunks(q, k))
    assert (qs[..., 2] >= qs[..., 3]).all() and (ks[..., 2] >= ks[..., 3]).all()


def test_sorted_ids_give_exact_spans():
    """Packed sequences: a tile inside one sequence spans exactly that sequence's keys."""
    q = np.repeat(np.arange(4, dtype=np.int32), 64)[None]  # 4 sequences of 64
    qs, _ = (np.asarray(x) for x in segment_chunks(q, q))
    for s in range(4):
        assert tuple(_tile_span(qs[0], 64 * s, 64, 256)) == (64 * s, 64 * s + 64)
        assert tuple(qs[0, 4 * s + 1, 4:6]) == (64 * s, 64 * s + 64)  # the run of one sequence
        assert tuple(qs[0, 4 * s + 1, 6:8]) == (64 * s, 64 * s + 64)  # and its keys


def _folds(summary):
    """Which chunks the Hopper kernel folds into key ranges (cuda/sm90/mask_policies.h, tile_rows): one
    id, a non-empty match run, and a key span equal to it."""
    lo, hi, begin, end, _, _, mb, me = (summary[..., i] for i in range(8))
    return (lo == hi) & (mb < me) & (begin == mb) & (end == me)


def _chunk_aligned(rng, length, count):
    cuts = np.sort(rng.integers(0, length // CHUNK + 1, size=count - 1)) * CHUNK
    return np.searchsorted(cuts, np.arange(length), side="right").astype(np.int32)


@pytest.mark.parametrize("kind", ["random_cuts", "chunk_aligned", "scattered"])
@pytest.mark.parametrize("T,S", [(256, 256), (1700, 1700), (1000, 1300), (33, 500)])
def test_folded_chunks_see_exactly_their_key_range(kind, T, S):
    """A folded chunk's rows see exactly the keys [match begin, match end): every key with their
    id lies there and nowhere else. Packed sequences on 16-key chunks always fold."""
    rng = np.random.default_rng(T * 7 + S)
    for _ in range(5):
        if kind == "random_cuts":
            q = np.sort(rng.integers(0, 4, T)).astype(np.int32)
            k = np.sort(rng.integers(0, 4, S)).astype(np.int32)
        elif kind == "chunk_aligned":
            q, k = _chunk_aligned(rng, T, 4), _chunk_aligned(rng, S, 4)
        else:
            runs = lambda n: np.repeat(rng.integers(0, 3, n), rng.integers(1, 60, n))[:n].astype(np.int32)  # noqa: E731
            q, k = runs(T), runs(S)
        qs = np.asarray(segment_chunks(q[None], k[None])[0])[0]
        folds = _folds(qs)
        for c in np.flatnonzero(folds):
            mb, me = qs[c, 6:8]
            assert np.array_equal(np.flatnonzero(k == q[c * CHUNK]), np.arange(mb, me)), (kind, c)
        if kind == "chunk_aligned":
            uniform = qs[:, 0] == qs[:, 1]
            present = np.isin(qs[:, 0], k)
            assert np.array_equal(folds, uniform & present), kind
