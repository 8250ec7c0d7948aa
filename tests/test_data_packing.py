"""jaxpar.data's plan, packing and batches, on token stores held in memory: every document once per
epoch, no token dropped, exact mixture shares, rows that do not depend on who asks for them, resume at
any step, the global masked mean under any split, and the reads of one process's rows."""
import time

import numpy as np
import pytest

from jaxpar.data import DataError, PackedBatches, StreamPlan, batch_digest
from jaxpar.data._packing import pack_window
from jaxpar.run import BatchRamp


class ArrayStore:
    """Documents held in memory (token ``doc * 1000 + i``), counting the tokens read."""

    def __init__(self, lengths, base=0):
        self.lengths = np.asarray(lengths, np.int64)
        self.name, self.base, self.bytes_read = f"memory{base}", base, 0

    def read(self, doc, start, stop):
        self.bytes_read += (stop - start) * 4
        return (self.base + doc * 1000 + np.arange(start, stop)).astype(np.int32)


def epoch_of(plan, source, window):
    """The epoch of ``source`` that ``window`` starts in (0-based)."""
    return int(plan.source_budget(window)[source] // int(plan.costs[source].sum()))


def lognormal_lengths(n, median, seed=0, sigma=1.0):
    return np.maximum(1, np.random.default_rng(seed).lognormal(np.log(median), sigma, n).astype(np.int64))


@pytest.mark.parametrize("method", ["best_fit", "first_fit"])
def test_pack_window_places_every_token_once(method):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 33, 60)
    pieces = np.stack([np.zeros(60, int), np.arange(60), np.zeros(60, int), lengths, lengths], 1)
    rows, stats = pack_window(pieces, rows=40, seq_len=32, method=method)
    placed = np.zeros(60, int)
    for segments in rows:
        assert sum(n for _, _, n in segments) <= 32
        for p, offset, n in segments:
            assert offset == placed[p]           # the parts of a split piece follow each other
            placed[p] += n
    assert (placed == lengths).all() and stats.tokens == lengths.sum()


def test_pack_window_splits_only_what_no_row_takes():
    pieces = np.array([[0, i, 0, n, n] for i, n in enumerate([6, 6, 6, 6])])
    rows, stats = pack_window(pieces, rows=3, seq_len=8, method="best_fit")   # 24 tokens in 24 places
    assert stats.split_pieces == 1 and stats.efficiency == 1.0
    with pytest.raises(DataError, match="do not fit"):
        pack_window(pieces, rows=2, seq_len=8, method="best_fit")


@pytest.mark.parametrize("method", ["best_fit", "first_fit", "none"])
def test_every_document_exactly_once_per_epoch(method):
    lengths = lognormal_lengths(300, 40, seed=2)
    plan = StreamPlan([lengths], [1.0], seq_len=64, rows_per_window=8, fill=0.9, method=method, seed=5)
    covered = [np.zeros(n, int) for n in lengths]
    epoch_docs, g = [], 0
    while epoch_of(plan, 0, g) == 0 and epoch_of(plan, 0, g + 1) == 0:
        pieces = plan.window_pieces(g)
        for _, doc, start, n, _ in pieces:
            covered[doc][start:start + n] += 1
        epoch_docs += pieces[:, 1].tolist()
        g += 1
    # the windows wholly inside epoch 0 cover each token at most once; the rest follows in the next window
    assert max(c.max() for c in covered) == 1
    assert sum(int(c.sum()) for c in covered) == g * plan.budget if method != "none" else True
    for _, doc, start, n, _ in plan.window_pieces(g):     # the window that crosses into epoch 1
        if covered[doc].sum() < lengths[doc]:
            covered[doc][start:start + n] += 1
    assert all((c == 1).all() for c in covered), "a document was left out or repeated in epoch 0"


def test_windows_are_full_and_lose_no_token():
    lengths = lognormal_lengths(5000, 500)
    plan = StreamPlan([lengths], [1.0], seq_len=2048, rows_per_window=64, fill=0.98, method="best_fit", seed=0)
    for g in range(20):
        pieces, rows, stats = plan.window(g)
        assert stats.tokens == plan.budget == int(0.98 * 64 * 2048)
        assert sum(n for r in rows for *_, n in r) == pieces[:, 3].sum()


def test_mixture_shares_are_exact_over_1e5_rows():
    a, b, c = lognormal_lengths(3000, 30, 1), lognormal_lengths(500, 80, 2), lognormal_lengths(50, 20, 3)
    plan = StreamPlan([a, b, c], [0.6, 0.3, 0.1], seq_len=64, rows_per_window=128, fill=0.95, method="best_fit",
                      seed=0)
    windows = 100_000 // 128
    got = np.zeros(3)
    for g in range(windows):
        pieces = plan.window_pieces(g)
        np.add.at(got, pieces[:, 0], pieces[:, 3])
    share = got / got.sum()
    assert np.abs(share - [0.6, 0.3, 0.1]).max() < 1e-4     # exact to a token per window
    assert epoch_of(plan, 2, windows) > 10                       # the small source repeats, epoch after epoch


def make_data(**kw):
    stores = [ArrayStore(lognormal_lengths(400, 50, 7)), ArrayStore(lognormal_lengths(300, 120, 8), base=10**7)]
    options = dict(seq_len=128, batch_size=16, seed=3, rows_per_window=8, eval_fraction=0.05)
    return PackedBatches(stores, [2.0, 1.0], **{**options, **kw}), stores


def test_rows_do_not_depend_on_who_asks():
    data, _ = make_data()
    for step in (0, 5, 77):
        full = data(step)
        for parts in (2, 4, 8):
            pieces = [data(step, rows=np.arange(i * 16 // parts, (i + 1) * 16 // parts)) for i in range(parts)]
            joined = {k: np.concatenate([p[k] for p in pieces]) for k in full}
            assert batch_digest(joined) == batch_digest(full)
            np.testing.assert_array_equal(joined["loss_weights"], full["loss_weights"])


def test_batch_arrays_are_consistent():
    data, _ = make_data()
    b = data(3)
    seg, mask, tok, tgt, pos = b["segment_ids"], b["loss_mask"], b["tokens"], b["targets"], b["positions"]
    assert (mask <= (seg > 0)).all()                                   # padding never counts
    same_doc = (tok // 1000)[:, 1:] == (tok // 1000)[:, :-1]
    inside = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    assert (tgt[:, :-1][inside] == tok[:, 1:][inside]).all()          # a target is the next token of its piece
    assert (tgt[mask == 1] == tok[mask == 1] + 1).all()               # ... and of its document
    assert (pos[:, 1:][inside] == pos[:, :-1][inside] + 1).all() and (pos[seg == 0] == 0).all()
    assert same_doc[inside].all()
    weights = b["loss_weights"]
    assert np.isclose(weights.mean(), 1.0) and (weights[mask == 0] == 0).all()


def test_a_fresh_loader_resumes_any_step_at_once():
    data, _ = make_data()
    stream = [batch_digest(data(s)) for s in range(40)]
    again, _ = make_data()
    assert [batch_digest(again(s)) for s in range(38, 40)] == stream[38:]
    far, _ = make_data(batch_size=1024, rows_per_window=64)
    t0 = time.perf_counter()
    far(10**6, rows=np.arange(8))
    assert time.perf_counter() - t0 < 1.0


def test_a_ramp_continues_the_same_rows():
    ramp = BatchRamp(sizes=(8, 16, 32), steps=(0, 10, 20))
    data, _ = make_data(batch_size=8, ramp=ramp)
    flat, _ = make_data(batch_size=8)                     # rows of a run without the ramp: 8 per step
    first = ramp.tokens_before(25, 1)
    np.testing.assert_array_equal(data(25)["tokens"], np.concatenate([flat(s)["tokens"] for s in range(first // 8, first // 8 + 4)]))
    resumed, _ = make_data(batch_size=8, ramp=ramp)
    assert batch_digest(resumed(25)) == batch_digest(data(25))


def test_prefetch_gives_the_same_batches():
    plain, _ = make_data()
    ahead, _ = make_data(prefetch=3)
    rows = np.arange(4, 12)
    for step in range(6):
        assert batch_digest(ahead(step, rows=rows)) == batch_digest(plain(step, rows=rows))
    ahead.close()


def test_a_process_reads_only_its_rows():
    data, stores = make_data()
    data(9, rows=np.arange(8, 12))
    expected = 0            # each segment's tokens, and the next token of its document for the last target
    for pieces, segments in data.plan.rows(9 * 16 + 8, 9 * 16 + 12):
        for p, offset, n in segments:
            expected += n + int(pieces[p, 2] + offset + n < pieces[p, 4])
    assert sum(s.bytes_read for s in stores) == 4 * expected


def test_held_out_documents_never_train():
    data, _ = make_data()
    held = {(s, int(d)) for s, ids in enumerate(data.eval_ids) for d in ids}
    assert held and not held & {(s, int(d)) for s, ids in enumerate(data.train_ids) for d in ids}
    evals = data.eval_batches(2)
    again, _ = make_data()
    assert [batch_digest(b) for b in evals] == [batch_digest(b) for b in again.eval_batches(2)]


def test_loss_weights_give_the_global_masked_mean_under_any_split():
    data, _ = make_data(batch_size=16, fill=0.6)        # much padding: the rows' real targets differ
    batch = data(4)
    mask, weights = batch["loss_mask"].astype(np.float64), batch["loss_weights"].astype(np.float64)
    loss = np.random.default_rng(0).random(mask.shape)   # any per-token loss
    exact = (loss * mask).sum() / mask.sum()
    for k in (2, 4, 8):                                  # micro-batch i takes rows i, i + k, ... (split_microbatches)
        means = [(loss[i::k] * weights[i::k]).mean() for i in range(k)]
        assert abs(np.mean(means) - exact) < 1e-6
        naive = [(loss[i::k] * mask[i::k]).sum() / max(mask[i::k].sum(), 1) for i in range(k)]   # cross_entropy with a mask
        assert abs(np.mean(naive) - exact) > 1e-4       # a mean of micro-batch means is not the global mean


def test_an_eval_fraction_that_holds_out_nothing_is_named():
    with pytest.raises(DataError, match=r"eval_fraction=0.001 holds out no tokens of source 1 \(memory"):
        PackedBatches([ArrayStore([5] * 4000), ArrayStore([5] * 10, base=1)], seq_len=8, batch_size=4,
                      eval_fraction=0.001)
