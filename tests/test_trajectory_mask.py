"""Training on multi-turn trajectories: a sample's observation tokens (`Sample.mask` 0) are context, never trained
on. The packed batch equals the same samples packed without a mask with the hand-built mask applied to the
loss mask and weights; an all-ones mask packs bit for bit what no mask packs (the single-turn path); the
aggregation counts only trained tokens; DistFlow's databuffer carries the mask across processes."""

import dataclasses

import numpy as np
import pytest

from jaxrl.config.train import AlgoSection, TrainConfig
from jaxrl.flow.databuffer import decode, encode
from jaxrl.train.batch import Sample, pack, pack_rows, trained_tokens
from jaxrl.train.rl import batch_weights, sample_weights


def _trajectories(rng, n=5):
    """Samples whose responses interleave sampled turns with 2-4 token observations, and their masks."""
    out = []
    for _ in range(n):
        mask = []
        for turn in range(int(rng.integers(1, 4))):
            if turn:
                mask += [0] * int(rng.integers(2, 5))
            mask += [1] * int(rng.integers(1, 6))
        out.append(Sample(rng.integers(3, 100, int(rng.integers(2, 9))).tolist(),
                          rng.integers(3, 100, len(mask)).tolist(), float(rng.normal()),
                          [float(x) for x in rng.normal(size=len(mask)).astype(np.float32)], mask=mask))
    return out


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_mask_equals_the_hand_built_mask(agg):
    rng = np.random.default_rng(0)
    samples = _trajectories(rng)
    cfg = TrainConfig(algo=AlgoSection(agg=agg))
    w, denom = batch_weights(samples, cfg, max_new_tokens=30)
    got = pack(samples, w, pack_len=64, behaviour=True)
    plain = [dataclasses.replace(s, mask=None) for s in samples]
    want = pack(plain, w, pack_len=64, behaviour=True)
    hand = np.zeros_like(want["loss_mask"])                 # the mask, placed by hand at the predicting indices
    for r, members in enumerate(pack_rows([len(s.prompt) + len(s.response) for s in samples], 64)):
        off = 0
        for i in members:
            s = samples[i]
            p = len(s.prompt)
            hand[r, off + p - 1:off + p - 1 + len(s.response)] = s.mask
            off += p + len(s.response)
    want["loss_mask"] = want["loss_mask"] * hand
    want["weights"] = (want["weights"] * hand).astype(np.float32)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert got["loss_mask"].sum() == sum(map(trained_tokens, samples)) < sum(len(s.response) for s in samples)


def test_all_ones_mask_packs_what_no_mask_packs():
    rng = np.random.default_rng(1)
    samples = [dataclasses.replace(s, mask=None) for s in _trajectories(rng)]
    ones = [dataclasses.replace(s, mask=[1] * len(s.response)) for s in samples]
    cfg = TrainConfig()
    w0, d0 = batch_weights(samples, cfg, max_new_tokens=30)
    w1, d1 = batch_weights(ones, cfg, max_new_tokens=30)
    np.testing.assert_array_equal(w0, w1)
    a, b = pack(samples, w0, pack_len=48, behaviour=True), pack(ones, w1, pack_len=48, behaviour=True)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_aggregation_counts_trained_tokens():
    rng = np.random.default_rng(2)
    samples = _trajectories(rng)
    trained = np.asarray([sum(s.mask) for s in samples], np.float64)
    w, denom = batch_weights(samples, TrainConfig(algo=AlgoSection(agg="token-mean")), max_new_tokens=30)
    np.testing.assert_array_equal(w, np.full(len(samples), 1.0 / trained.sum()))
    w, denom = batch_weights(samples, TrainConfig(algo=AlgoSection(agg="seq-mean-token-mean")), max_new_tokens=30)
    np.testing.assert_array_equal(w, 1.0 / (len(samples) * trained))
    np.testing.assert_array_equal(sample_weights(samples, TrainConfig(algo=AlgoSection(agg="seq-mean-token-mean")),
                                                 30), 1.0 / trained)
    with pytest.raises(ValueError, match="a mask of 2"):
        pack([Sample([1, 2], [3, 4, 5], 0.0, mask=[1, 0])], [1.0], pack_len=16)


def test_the_databuffer_carries_the_mask():
    rng = np.random.default_rng(3)
    samples = _trajectories(rng) + [Sample([1, 2], [3, 4], 0.5, None, 2)]
    back = decode({k: v[0] for k, v in encode(samples, 40, 0).items()})
    for a, b in zip(samples, back, strict=True):
        assert (a.prompt, a.response, a.logprobs, a.version, a.mask) == (b.prompt, b.response, b.logprobs, b.version,
                                                                         b.mask)
