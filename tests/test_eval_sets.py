"""data.eval_sets: named held-out sets scored at every evaluation beside the main held-out text,
under the main keys with /<name> after them. A set of the main held-out files scores exactly as
the main evaluation, on a sharded mesh and on one device; two sets give their own numbers in
metrics.jsonl, summary.json and nljax.evaluate; bad input is one line, exit 2, nothing written."""

import json
import math
import random
import re

import jax
import pytest
from helpers import QUICK, TINY, TINY_NL, Setup

from nljax import config, evaluate
from nljax.train import main as train_main

WORDS = "the a memory level stream token window model learns reads writes data file line of and to in".split()


def _write(path, n_docs: int, seed: int, words=WORDS) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))}) + "\n"
                            for _ in range(n_docs)))


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Training text, held-out text, and another held-out text of other words (.jsonl)."""
    root = tmp_path_factory.mktemp("texts")
    _write(root / "train" / "t.jsonl", 40, 0)
    _write(root / "held" / "h.jsonl", 12, 1)
    _write(root / "other" / "o.jsonl", 12, 2, "zebra quartz jungle vex flick gym dwarf".split())
    return root


@pytest.fixture(scope="module")
def tokenizer(texts, tmp_path_factory):
    """A byte-level BPE tokenizer of 300 tokens trained here on the texts (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = [json.loads(line)["text"] for p in sorted(texts.glob("*/*.jsonl")) for line in p.read_text().splitlines()]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


# a memory, so that the streaming evaluation carries something; one CMS level; the tokenizer's
# vocabulary for bytes too (one model shape: the runs share their compiled programs)
NL = [*TINY, *TINY_NL, "cms.periods=[1]", "eval.batches=2", "eval.stream_steps=2", "model.vocab_size=300"]


@pytest.mark.parametrize("inter,intra,tokens", [(1, 1, "bytes"), (2, 4, "bytes"), (2, 4, "bpe")])
def test_a_set_of_the_held_out_files_scores_as_the_main_evaluation(texts, tokenizer, inter, intra, tokens):
    """data.eval=X and data.eval_sets same=X: the same numbers (bits per byte too: with a
    tokenizer, the set's tokens per byte are the held-out text's)."""
    tok = [f"data.tokenizer={tokenizer}"] if tokens == "bpe" else []
    cfg = config.load(None, [*NL, *tok, "data.source=files", f"data.train={texts}/train/*.jsonl",
                             f"data.eval={texts}/held/*.jsonl", f"data.eval_sets=[same={texts}/held/*.jsonl,"
                             f"other={texts}/other/*.jsonl]", f"mesh.inter={inter}", f"mesh.intra={intra}"])
    s = Setup.create(cfg, jax.devices()[: inter * intra])
    if tokens == "bpe":  # ids above 255, fewer tokens than bytes
        assert s.task.eval_sets[0].tokens.max() > 255 and s.task.data.tokens_per_byte < 0.9
    out = s.evaluate(s.state.params)
    for key in ("eval_loss", "eval_bpb", "eval_tokens", "eval_loss_stream", "eval_bpb_stream", "eval_tokens_stream"):
        assert out[f"{key}/same"] == out[key], key  # the same windows, the same programs
    assert out["eval_tokens"] == 2 * 8 * 8 and out["eval_tokens_stream"] == 2 * 8 * 8
    assert out["eval_loss/other"] != out["eval_loss"] and math.isfinite(out["eval_loss/other"])
    assert s.task.describe()["eval_sets"] == {"same": len(s.task.eval_data),
                                              "other": len(s.task.eval_sets[1].tokens)}


# a tiny run, evaluated after 2 steps and at the end (3), a checkpoint at each
RUN = [*TINY, *QUICK, "cms.periods=[1]", "mesh.inter=2", "mesh.intra=4", "train.steps=3", "eval.every=2",
       "checkpoint.every=2", "eval.batches=1", "eval.stream_steps=1", "run.quiet=true"]
KEYS = ("eval_loss", "eval_bpb", "eval_tokens", "eval_loss_stream", "eval_bpb_stream", "eval_tokens_stream")


def test_two_sets_report_their_own_numbers_everywhere(texts, tmp_path, capsys):
    """A run on the standard library (bytes) with two sets of files: metrics.jsonl, summary.json,
    the console line and nljax.evaluate (the run's sets, and another given on its command line)."""
    run = tmp_path / "run"
    sets = f"data.eval_sets=[held={texts}/held/*.jsonl,other={texts}/other/*.jsonl]"
    assert train_main(["--quiet", *RUN, sets, f"run.dir={run}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = next(r for r in records if "eval_loss" in r)
    for where in (summary, evaluated):
        for key in KEYS:
            assert key + "/held" in where and key + "/other" in where, key
        assert where["eval_loss/held"] != where["eval_loss/other"] != where["eval_loss"]
        assert where["eval_tokens/held"] == where["eval_tokens/other"] == 8 * 8
    assert evaluated["eval_loss/held"] != summary["eval_loss/held"]  # after 2 steps, after 3
    # each document as bytes and its end (NUL): the .jsonl's text fields
    held = sum(len(json.loads(line)["text"].encode()) + 1 for line in (texts / "held" / "h.jsonl").read_text().splitlines())
    assert summary["data"]["eval_sets"]["held"] == held
    for key in summary:  # the trackers' tags (`eval/<key>`) as TensorBoard keeps them
        assert re.fullmatch(r"[-/\w.]+", f"eval/{key}"), key
    # nljax.evaluate: the run's sets, the numbers it reported
    out = tmp_path / "final.json"
    assert evaluate.main([f"run.dir={run}", f"out={out}"]) == 0
    printed = dict(line.split() for line in capsys.readouterr().out.splitlines())
    result = json.loads(out.read_text())
    for key in [k + s for k in KEYS for s in ("/held", "/other")]:
        assert result[key] == pytest.approx(summary[key], rel=1e-6), key
        assert float(printed[key]) == result[key]
    assert result["eval_bpt/other"] == pytest.approx(result["eval_loss/other"] / math.log(2))
    assert result["data"]["eval_sets"] == summary["data"]["eval_sets"]
    # a set the run lacked, given on the command line (in place of the run's), on one device
    given = evaluate.scores(evaluate.load(str(run), overrides=[f"data.eval_sets=new={texts}/other/*.jsonl"],
                                          devices=jax.devices()[:1]))
    assert given["eval_loss/new"] == pytest.approx(summary["eval_loss/other"], rel=1e-5)
    assert not any(k.endswith("/held") for k in given)


def test_a_set_too_short_or_matching_nothing_is_one_line(texts, tmp_path, capsys):
    """Refused when the files are read: by nljax.train before anything is written, by
    nljax.evaluate before anything is scored."""
    (tmp_path / "tiny.txt").write_text("short")  # 6 tokens (its end too) < train.seq_len + 1 = 9
    cases = [(f"data.eval_sets=[a={tmp_path}/*.nothing]", f"data.eval_sets a: '{tmp_path}/*.nothing' matches no file"),
             (f"data.eval_sets=[a={tmp_path}/tiny.txt]", "data.eval_sets a: 6 tokens in 1 file(s)")]
    for setting, message in cases:
        run = tmp_path / "run"
        assert train_main(["--quiet", *RUN, setting, f"run.dir={run}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"nljax.train: error: {message}"), err
        assert not run.exists()


BAD = [
    ("data.eval_sets=[=x.txt]", "data.eval_sets: '=x.txt' has an empty name"),
    ("data.eval_sets=[1a=x.txt]", "data.eval_sets: '1a' is not a simple name"),
    ("data.eval_sets=[a-b=x.txt]", "data.eval_sets: 'a-b' is not a simple name"),
    ("data.eval_sets=[x.txt]", "data.eval_sets: 'x.txt' must be name=glob"),
    ("data.eval_sets=[a=]", "data.eval_sets: 'a=' names no files"),
    ("data.eval_sets=[a=x.txt,a=y.txt]", "data.eval_sets names the set 'a' twice"),
]


@pytest.mark.parametrize("setting, message", BAD, ids=[m.split(":")[-1][:24].strip() for _, m in BAD])
def test_bad_names_are_one_line(tmp_path, capsys, setting, message):
    run = tmp_path / "run"
    assert train_main(["--quiet", *RUN, setting, f"run.dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"nljax.train: error: {message}"), err
    assert not run.exists()


def test_an_image_model_refuses_sets(tmp_path, capsys):
    run = tmp_path / "run"
    assert train_main(["--quiet", "model.name=dit", "cms.periods=[1]", f"data.eval_sets=[a={tmp_path}/x.txt]", f"run.dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.eval_sets holds held-out text, and model.name=dit makes images" in err[0], err


def test_loss_png_draws_each_sets_losses_under_its_name():
    """loss.png: a set's losses beside the main ones, its name in the legend; its other keys are
    not losses, whatever the name (a set named `lossy`: eval_bpb/lossy is bits per byte)."""
    from nljax.measure import plots

    records = [{"step": s, "loss": 3.0 - s / 10} for s in range(4)]
    records[1].update({"eval_loss": 2.5, "eval_loss/lossy": 2.7, "eval_bpb/lossy": 3.9, "eval_tokens/lossy": 64})
    fig = plots.loss_figure(records, {"eval_loss": 2.4, "eval_loss/lossy": 2.6, "eval_bpb/lossy": 3.7}, 1.44)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["training loss", "held-out loss (fresh memory)", "held-out loss (fresh memory), lossy"]
