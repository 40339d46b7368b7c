"""Evaluation counts every held-out example exactly once, whatever the device count."""

import numpy as np
import pytest

from nljax.data.text import eval_batches, eval_windows

from helpers import make


def test_eval_batches_pad_and_mask():
    windows = np.arange(11 * 5, dtype=np.int32).reshape(11, 5)
    batches = list(eval_batches(windows, 4))
    assert [b["mask"].sum() for b in batches] == [4, 4, 3]
    real = np.concatenate([b["tokens"][b["mask"] > 0] for b in batches])
    np.testing.assert_array_equal(real, windows)


@pytest.mark.parametrize("inter,intra", [(1, 2), (2, 4)])
def test_eval_loss_independent_of_device_count(inter, intra):
    # 8 rows per batch and 3 batches' worth of windows minus 5: the last batch is partly padding
    over = ["eval.batches=3", "data.eval_fraction=0.05", "eval.stream_steps=0"]  # fresh-memory eval only
    one = make(over, 1, 1)
    many = make(over, inter, intra)
    windows = eval_windows(one.task.eval_data, one.cfg.train.seq_len, 19)
    assert len(windows) == 19
    one.task.eval_data = many.task.eval_data = one.task.eval_data[: 19 * one.cfg.train.seq_len + 1]
    a, b = one.evaluate(one.state.params), many.evaluate(many.state.params)
    assert a["eval_tokens"] == b["eval_tokens"] == 19 * one.cfg.train.seq_len
    assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6)
