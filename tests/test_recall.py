"""The associative-recall probe: the corpus layout, the accuracy metric, training on it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, assert_trees_equal, make, train

from nljax import config
from nljax.config import ConfigError
from nljax.data.recall import CHANCE, document, recall_corpus
from nljax.models.layers import token_hits

DOC = re.compile(rb"((?:[a-z]{3}=\d{4};)+)([A-Z ]+?)((?:[a-z]{3}\?\d{4};)+)[A-Z ]*\x00")  # key_len 3, value_len 4
VALUE_LEN = 4


def test_corpus_is_deterministic_and_has_the_layout():
    args = dict(docs=40, doc_len=96, pairs=3, gap=30, reach=20, eval_fraction=0.25, key_len=3, value_len=VALUE_LEN)
    train_bytes, train_score, held, score = corpus = recall_corpus(**args, seed=1)
    again = recall_corpus.__wrapped__(**args, seed=1)  # not the cached arrays
    assert_trees_equal(corpus, again)
    assert not np.array_equal(held, recall_corpus(**args, seed=2)[2])
    assert len(train_bytes) == len(train_score) == 30 * 96 and len(held) == len(score) == 10 * 96
    docs = [(text[d * 96 : (d + 1) * 96].tobytes(), s[d * 96 : (d + 1) * 96])
            for text, s, n in ((train_bytes, train_score, 30), (held, score, 10)) for d in range(n)]
    for doc, s in docs:
        m = DOC.fullmatch(doc)
        assert m, doc
        pairs = dict(re.findall(rb"([a-z]+)=(\d+);", m.group(1)))
        queries = re.findall(rb"([a-z]+)\?(\d+);", m.group(3))
        assert len(pairs) == 3 and sorted(k for k, _ in queries) == sorted(pairs)  # every key once
        assert all(pairs[k] == v for k, v in queries)
        assert len(m.group(2)) == 30  # the gap
        # scored: exactly the value bytes of the queries, each predicted > reach tokens after its pair
        start = m.start(3)
        values = [start + q.start(1) + j for q in re.finditer(rb"[a-z]+\?(\d+);", m.group(3)) for j in range(VALUE_LEN)]
        assert np.flatnonzero(s).tolist() == values
        pair_end = {p.group(1): p.end() - 1 for p in re.finditer(rb"([a-z]+)=\d+;", m.group(1))}  # its `;`
        for q in re.finditer(rb"([a-z]+)\?", m.group(3)):
            assert start + q.end() - 1 - pair_end[q.group(1)] > 20  # from the `?`, the first predictor
    # a gap inside the reach leaves queries unscored
    assert recall_corpus(**{**args, "reach": 45}, seed=1)[3].sum() < score.sum()


def test_keys_are_distinct_and_a_value_at_the_reach_is_not_scored():
    """A document's keys are distinct (26 one-letter keys for 20 pairs: drawn alone, some would
    repeat, a query with two answers), and a value byte is scored exactly when its pair ended more
    than `reach` tokens before the position that predicts it: one at the reach itself is within
    the attention's sight."""
    make_doc = lambda reach: document(np.random.default_rng(3), 200, 20, 5, reach, 1, 1)
    doc, everything = make_doc(-1)
    pairs = re.findall(rb"([a-z])=(\d);", doc)
    assert len(pairs) == 20 and len({k for k, _ in pairs}) == 20
    pair_end = {m.group(1): m.end() - 1 for m in re.finditer(rb"([a-z])=\d;", doc)}
    query = {m.start(2): m.group(1) for m in re.finditer(rb"([a-z])\?(\d);", doc)}  # value byte -> its key
    assert np.flatnonzero(everything).tolist() == sorted(query)
    distance = {at: at - 1 - pair_end[key] for at, key in query.items()}
    reach = sorted(distance.values())[5]  # some values at most this far, the others farther
    doc_again, score = make_doc(reach)
    assert doc_again == doc
    assert np.flatnonzero(score).tolist() == sorted(at for at, d in distance.items() if d > reach)
    assert 0 < score.sum() < len(query)


def test_token_hits_on_hand_made_logits():
    targets = np.array([[1, 2, 0, 3]])  # [B=1, T=4]
    logits = np.full((1, 4, 4), -1.0, np.float32)
    logits[0, 0, 1] = 5  # right
    logits[0, 1, 3] = 5  # wrong (target 2)
    logits[0, 2, 0] = 5  # right, but not scored
    logits[0, 3, 3] = 5  # right
    score = np.array([[1, 1, 0, 1]], np.float32)
    hits, scored = token_hits(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(score))
    assert (float(hits), float(scored)) == (2.0, 3.0)


RECALL = ["data.source=recall", "model.nl_lm.window=8", "train.seq_len=64", "data.recall_pairs=2", "data.recall_gap=16",
          "data.recall_docs=800", "eval.batches=1", "eval.stream_steps=4"]


def test_recall_task_trains_and_reports_accuracy():
    setup = make(RECALL, 2, 4)
    losses, state = train(setup, 2)
    assert np.all(np.isfinite(losses))
    out = setup.evaluate(state.params)
    assert out["eval_recall_chance"] == CHANCE == 0.1
    assert out["eval_recall_scored"] == 8 * 4 * 2 * 2  # rows x windows x queries x value bytes (value_len 2)
    # the same accuracy recomputed on the host from the model's logits, window by window
    hits = 0.0
    params = jax.device_get(state.params)
    for b in setup.task.held_out().batches(4):
        assert b["reset"].all()  # one document per window: every window starts a document
        logits, _ = setup.engine.model.logits(params, {}, b)
        right = np.argmax(np.asarray(logits), -1) == b["tokens"][:, 1:]
        hits += float((right * b["score"]).sum())
    assert out["eval_recall_acc"] == pytest.approx(hits / out["eval_recall_scored"])


def test_values_loss_is_the_mean_over_the_queried_values_on_any_mesh():
    """data.recall_loss=values: a training batch weighs exactly the scored value bytes, the loss is
    their mean cross-entropy, and 8 devices train as 1 does (every row weighs the same)."""
    one = make(RECALL, 1, 1)
    batch = jax.device_get(one.batch(0))
    assert batch["weight"].sum(axis=1).tolist() == [2 * 2] * 8  # queries x value bytes, every row
    targets = batch["tokens"][:, 1:]
    assert set(np.unique(targets[batch["weight"] > 0]).tolist()) <= set(range(ord("0"), ord("9") + 1))
    logits, _ = one.engine.model.logits(jax.device_get(one.state.params), {}, batch)
    nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), targets[..., None], -1)[..., 0]
    losses, state = train(one, 3)
    assert losses[0] == pytest.approx(float((nll * batch["weight"]).sum() / batch["weight"].sum()), rel=1e-5)
    assert "weight" not in make([*RECALL, "data.recall_loss=all"]).batch(0)
    many_losses, many = train(make(RECALL, 2, 4), 3)
    np.testing.assert_allclose(many_losses, losses, rtol=1e-5)
    assert_trees_close(jax.device_get(many.params), jax.device_get(state.params), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("override,match", [
    ("data.recall_gap=13", "reach"),  # depth 2 x (window 8 - 1) = 14
    ("data.recall_pairs=4", "more than train.seq_len"),  # 2 x 4 x len("ab=12;") + 16 + 1 = 65
    ("data.recall_key_len=0", "recall_key_len"),
    ("data.recall_value_len=0", "recall_value_len"),
    ("eval.stream_steps=0", "eval.stream_steps"),
])
def test_recall_config_errors(override, match):
    from helpers import TINY

    over = [*TINY, *RECALL, "model.name=nl_lm", "model.nl_lm.window=8", "model.depth=2", override]
    with pytest.raises(ConfigError, match=match):
        config.load(None, over)
    if override.startswith("data.recall_gap"):  # the attention's reach: nl_lm's; cms_mlp has none
        config.load(None, [*over, "model.name=cms_mlp"])
