"""Evaluation counts every held-out example exactly once, whatever the device count; the
streaming evaluation carries each row's memory from window to window, the same on any mesh."""

import functools

import jax
import numpy as np
import pytest
from helpers import TINY_NL, assert_trees_close, make

from nljax.config import ConfigError
from nljax.data.text import HeldOutStream, eval_batches, eval_windows
from nljax.parallel.hostdev import host_sum, put_batch


def test_eval_batches_pad_and_mask():
    windows = np.arange(11 * 5, dtype=np.int32).reshape(11, 5)
    batches = list(eval_batches(windows, 4))
    assert [b["mask"].sum() for b in batches] == [4, 4, 3]
    real = np.concatenate([b["tokens"][b["mask"] > 0] for b in batches])
    np.testing.assert_array_equal(real, windows)
    # every window is scored from the learnt memory0, whatever state the rows hold
    assert all(b["reset"].dtype == bool and b["reset"].all() for b in batches)


def test_eval_windows_are_every_whole_window_of_the_text():
    """Windows of T+1 tokens start at multiples of T: as many as end within the text, whatever
    its length's remainder (one of exactly k*T tokens holds k-1: the k-th lacks its last target)."""
    for n in (16, 17, 19, 20, 21):
        data = np.arange(n, dtype=np.uint8)
        windows = eval_windows(data, 4, 0)
        assert len(windows) == (n - 1) // 4, n
        np.testing.assert_array_equal(windows, [data[i * 4 : i * 4 + 5] for i in range(len(windows))])
    assert len(eval_windows(np.arange(21, dtype=np.uint8), 4, 2)) == 2  # at most `limit`


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
    # and the value itself: the mean next-token loss of the 19 windows, each from a fresh memory,
    # computed here from the model's logits (padded rows must not count)
    model, params = one.engine.model, jax.device_get(one.state.params)
    logits, _ = model.logits(params, model.init_memory(len(windows)),
                             {"tokens": windows, "reset": np.ones(len(windows), bool)})
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), -1)
    want = -np.take_along_axis(np.asarray(logp), windows[:, 1:, None], -1).mean()
    assert a["eval_loss"] == pytest.approx(want, rel=1e-5)


# --- streaming evaluation: the memory carried from window to window --------------------------

NL = [*TINY_NL, "model.nl_lm.window=4", "model.nl_lm.memory_dim=4", "eval.batches=1", "eval.stream_steps=3"]


def perturbed(setup, scale=0.3):
    """The run's parameters plus fixed noise, placed as the run places them. At init the memory's
    output projection is zero, so the memory could not change the loss."""
    params = jax.device_get(setup.state.params)
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    noisy = [x + scale * rng.standard_normal(x.shape).astype(x.dtype) for x in leaves]
    return jax.device_put(jax.tree.unflatten(tree, noisy), jax.tree.map(lambda a: a.sharding, setup.state.params))


@functools.lru_cache(maxsize=None)
def stream_reference():
    one = make(NL, 1, 1)
    return one.task.evaluate_stream(one.cache, perturbed(one), one.task.held_out().batches(3))


@pytest.mark.parametrize("inter,intra", [(2, 4), (4, 2)])
def test_stream_eval_independent_of_mesh(inter, intra):
    many = make(NL, inter, intra)
    got = many.task.evaluate_stream(many.cache, perturbed(many), many.task.held_out().batches(3))
    ref = stream_reference()
    assert got["eval_tokens_stream"] == ref["eval_tokens_stream"] == 8 * 3 * 8
    assert got["eval_bpb_stream"] == pytest.approx(ref["eval_bpb_stream"], rel=1e-5)


def test_stream_eval_carries_memory():
    setup = make(NL, 2, 4)
    params, task = perturbed(setup), setup.task
    batches = list(task.held_out().batches(3))
    assert batches[0]["reset"].all() and not batches[1]["reset"].all()  # some rows carry into window 1
    train_memory = jax.device_get(setup.state.memory)
    carried = task.evaluate_stream(setup.cache, params, batches)
    fresh = task.evaluate_stream(setup.cache, params, [{**b, "reset": np.ones_like(b["reset"])} for b in batches])
    assert abs(carried["eval_loss_stream"] - fresh["eval_loss_stream"]) > 1e-4
    # the memory handed to window 1 is the one window 0 wrote: rows differ (a reset memory is
    # memory0 in every row)
    _, after0 = setup.cache.eval_stream(params, setup.cache.eval_memory(), put_batch(batches[0], setup.mesh))
    assert all(np.ptp(x, axis=0).max() > 0 for x in jax.tree.leaves(jax.device_get(after0)))
    # the training state's memory is neither donated nor changed by an evaluation
    assert_trees_close(jax.device_get(setup.state.memory), train_memory, rtol=0, atol=0)


def test_stream_eval_without_memory_is_the_plain_loss():
    setup = make(["eval.stream_steps=3"], 2, 4)
    params, task = perturbed(setup), setup.task
    batches = list(task.held_out().batches(3))
    stream = task.evaluate_stream(setup.cache, params, batches)
    windows = np.concatenate([b["tokens"] for b in batches])
    loss = count = 0.0
    for b in eval_batches(windows, 8):
        m = setup.cache.eval(params, put_batch(b, setup.mesh))
        loss, count = loss + host_sum(m["loss_sum"]), count + host_sum(m["count"])
    assert stream["eval_tokens_stream"] == count
    assert stream["eval_loss_stream"] == pytest.approx(loss / count, rel=1e-6)


def test_held_out_stream_layout():
    data = np.frombuffer(b"abcdefghij\0klmnopqrstuvwxyz0123456789\0ABCDEFGHIJKLM", np.uint8)  # 51 bytes
    s = HeldOutStream(data, rows=2, seq_len=4)
    assert s.span == 24  # (51 - 1) // 2 rows // 4 * 4
    batches = list(s.batches(3))
    for step, b in enumerate(batches):
        for r in range(2):
            start = r * 24 + 4 * step
            np.testing.assert_array_equal(b["tokens"][r], data[start : start + 5])
    # reset: the first window, then where the previous window held a NUL (bytes 8-11 hold byte 10)
    assert [list(b["reset"]) for b in batches] == [[True, True], [False, False], [False, False]]
    assert list(list(s.batches(4))[3]["reset"]) == [True, False]
    with pytest.raises(ConfigError, match="eval.stream_steps=7"):
        list(s.batches(7))


def test_held_out_scores_are_of_the_targets():
    """`score` marks held-out tokens whose prediction counts (the recall probe's values): a
    batch carries it per target position, token t + 1 of the window for position t."""
    data = np.arange(51, dtype=np.uint8)
    score = (np.arange(51) % 3 == 0).astype(np.float32)
    s = HeldOutStream(data, rows=2, seq_len=4, score=score)
    for step, b in enumerate(s.batches(3)):
        for r in range(2):
            targets = b["tokens"][r, 1:]  # the window's tokens are their own indices here
            np.testing.assert_array_equal(b["score"][r], score[targets])


def test_fresh_evaluation_dispatches_every_batch_before_reading_one(monkeypatch):
    # a read of a batch's loss waits for it: read after each batch, the devices idled while the
    # host built and sent the next one (the streaming evaluation already read after the last)
    from nljax.run import tasks

    setup = make(["eval.batches=3", "data.eval_fraction=0.05", "eval.stream_steps=0"])
    events, evaluate = [], setup.cache.eval
    monkeypatch.setattr(setup.cache, "eval", lambda *a: events.append("dispatch") or evaluate(*a))
    monkeypatch.setattr(tasks, "host_sum", lambda x: events.append("read") or host_sum(x))
    setup.task.evaluate_fresh(setup.cache, setup.state.params)
    assert events == ["dispatch"] * 3 + ["read"] * 6
