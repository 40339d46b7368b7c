"""data.eval_sets: named held-out sets scored at every evaluation beside the main held-out text,
under the main keys with /<name> after them. A set of the main held-out files scores exactly as
the main evaluation, on a sharded mesh and on one device; two sets give their own numbers in
metrics.jsonl, summary.json and nljax.evaluate, one short group each on the console and one
colour each in loss.png; each set's content digest is in the start-up lockstep record and the
checkpoints, and a resume warns of a set whose text changed or that was left out (and notes one
added); bad input is one line, exit 2, nothing written."""

import json
import math
import random
import re
import shutil
import types

import jax
import pytest
from helpers import QUICK, TINY, TINY_NL, Setup

from nljax import config, evaluate
from nljax.checkpoint import storage
from nljax.data import evalsets
from nljax.runtime import distributed, runlog
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
    the checkpoints' record of each set's content digest, and nljax.evaluate (the run's sets, and
    another given on its command line); resumed with one set's file edited, a warning names it."""
    run = tmp_path / "run"
    shutil.copytree(texts / "other", tmp_path / "other")  # edited below
    sets = f"data.eval_sets=[held={texts}/held/*.jsonl,other={tmp_path}/other/*.jsonl]"
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
    digests = summary["data"]["eval_set_digests"]
    assert sorted(digests) == ["held", "other"] and digests["held"] != digests["other"]
    for step in (2, 3):  # every checkpoint records them
        assert storage.read_meta(run / "checkpoints" / str(step))["data"]["eval_sets"] == digests
    for key in summary:  # the trackers' tags (`eval/<key>`) as TensorBoard keeps them
        assert re.fullmatch(r"[-/\w.]+", f"eval/{key}"), key
    # nljax.evaluate: the run's sets, the numbers it reported
    out = tmp_path / "final.json"
    assert evaluate.main([f"run.dir={run}", f"out={out}"]) == 0
    said = capsys.readouterr()
    printed = dict(line.split() for line in said.out.splitlines())
    assert f", set held ({held:,} tokens, digest {digests['held'][:12]})" in said.err  # as checkpoints record it
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
    # one set's file edited, resumed with a set added (a setting that trains nothing: silent):
    # one warning, naming the set whose content changed
    _write(tmp_path / "other" / "o.jsonl", 12, 3, "zebra quartz jungle vex flick gym dwarf".split())
    more = f"{sets[:-1]},new={texts}/held/*.jsonl]"
    capsys.readouterr()
    assert train_main(["--quiet", *RUN, more, f"run.dir={run}", "--resume", "train.steps=4", "throughput.reps=0"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    now = json.loads((run / "summary.json").read_text())["data"]["eval_set_digests"]
    assert now["held"] == now["new"] == digests["held"] and now["other"] != digests["other"]
    assert warned == [f"nljax: warning: data.eval_sets other changed since checkpoint {run / 'checkpoints' / '3'} "
                      f"(digest {digests['other'][:12]} there, {now['other'][:12]} here): eval_loss/other and its "
                      "other scores before and after this resume are not comparable"], warned
    assert storage.read_meta(run / "checkpoints" / "4")["data"]["eval_sets"] == now


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


def test_loss_png_gives_each_held_out_text_one_colour():
    """Each text (the main one, each set) one colour for its losses and its bits per byte, the
    fresh memory's solid and the carried memory's dashed; with sets, whose tokens per byte are
    their own, the bits per byte are a panel below the losses."""
    from nljax.measure import plots

    records = [{"step": s, "loss": 3.0 - s / 10} for s in range(4)]
    for suffix, loss in (("", 2.5), ("/a", 2.7), ("/b", 2.9)):
        records[1].update({f"eval_loss{suffix}": loss, f"eval_bpb{suffix}": loss * 1.6,
                           f"eval_loss_stream{suffix}": loss - 0.1, f"eval_bpb_stream{suffix}": (loss - 0.1) * 1.6,
                           f"eval_tokens{suffix}": 64})
    fig = plots.loss_figure(records, {}, 1.44)
    top, low = fig.axes[:2]
    assert low.get_ylabel().startswith("bits per byte") and not top.child_axes  # no right axis of one ratio
    drawn = {}  # (key's text, panel, fresh or carried) -> (colour, line style)
    for panel, ax in (("loss", top), ("bpb", low)):
        for line in ax.get_lines()[1 if panel == "loss" else 0:]:  # past the training loss
            base, _, rest = line.get_label().partition(", ")
            drawn[(rest, panel, "carried" in base)] = (line.get_color(), line.get_linestyle())
    assert len(drawn) == 12, drawn  # 3 texts x 2 panels x fresh and carried
    for text in ("", "a", "b"):
        colours = {drawn[(text, panel, carried)][0] for panel in ("loss", "bpb") for carried in (False, True)}
        assert len(colours) == 1, (text, colours)
        for panel in ("loss", "bpb"):
            assert drawn[(text, panel, False)][1] == "-" and drawn[(text, panel, True)][1] == "--"
    assert len({drawn[(text, "loss", False)][0] for text in ("", "a", "b")}) == 3
    assert top.get_lines()[0].get_color() not in {c for c, _ in drawn.values()}  # the training loss's own


def test_the_console_line_gives_each_set_one_short_group():
    """The evaluation's console line: the main keys as they were, then `name: loss/bpb (stream
    loss/bpb)` per set, not its six keys (metrics.jsonl keeps them)."""
    main = {"eval_loss": 2.5, "eval_bpb": 3.61, "eval_tokens": 1024, "eval_loss_stream": 2.25,
            "eval_bpb_stream": 3.25, "eval_tokens_stream": 1024}
    metrics = dict(main)
    for name, shift in (("wiki", 0.5), ("code", 1.0)):
        metrics.update({f"{k}/{name}": v + shift if isinstance(v, float) else v for k, v in main.items()})
    del metrics["eval_loss_stream/code"], metrics["eval_bpb_stream/code"]  # its streaming evaluation off
    line = runlog.format_metrics(metrics)
    assert line == (runlog.format_metrics(main) + "  sets (loss/bpb)  wiki: 3.000/4.110 (stream 2.750/3.750)  "
                    "code: 3.500/4.610"), line
    assert "/wiki" not in line and "/code" not in line


def test_the_console_line_shows_other_slashed_keys_as_they_are():
    """A key with a '/' that is no set's score (a task's or a hook's: `acc/foo`, an lm-eval style
    `lm_eval/hellaswag/acc`) is a plain `key value` pair, not dropped as a set without a loss;
    the sets beside it keep their group."""
    metrics = {"eval_loss": 2.5, "acc/foo": 0.75, "lm_eval/hellaswag/acc": 0.3125, "count/bar": 7,
               "eval_loss/wiki": 3.0, "eval_bpb/wiki": 4.11, "eval_tokens/wiki": 64}
    line = runlog.format_metrics(metrics)
    assert line == ("eval_loss 2.500  acc/foo 0.7500  lm_eval/hellaswag/acc 0.3125  count/bar 7  "
                    "sets (loss/bpb)  wiki: 3.000/4.110"), line


def test_the_console_metrics_keep_their_width_from_line_to_line():
    """A metric has four significant digits, trailing zeros kept: with `:.4g` the lines read
    `eval_loss 2.31` then `eval_loss 2.307`, ragged. No '1234.' (the '#' form's trailing point):
    1000 and over as an integer with separators; tiny values in the exponent form."""
    lines = [runlog.format_metrics({"eval_loss": v, "eval_bpb": v + 1, "eval_loss/wiki": v, "eval_bpb/wiki": v})
             for v in (2.31, 2.307, 2.3, 2.0)]
    assert lines[0] == "eval_loss 2.310  eval_bpb 3.310  sets (loss/bpb)  wiki: 2.310/2.310", lines[0]
    assert len({len(line) for line in lines}) == 1, lines
    assert [runlog.sig4(v) for v in (0.0, 0.1, -1.5, 999.94, 999.97, 1234.0, 9999.7, 123456.7, 2e9, 1.23e-5)] == [
        "0.000", "0.1000", "-1.500", "999.9", "1,000", "1,234", "10,000", "123,457", "2.000e+09", "1.230e-05"]
    assert [runlog.sig4(v) for v in (float("nan"), float("inf"), -float("inf"))] == ["nan", "inf", "-inf"]
    progress = runlog.Progress(10, 0, 1, quiet=True)
    assert progress.error_text({"eval_mse": 1.5}) == "  held-out mse (unweighted) 1.500"


def test_a_sets_content_digest_is_in_the_start_up_check(texts, tmp_path, monkeypatch):
    """The start-up record the processes compare holds each set's content digest: the same text
    under another path is the same digest, an edited file another, which the mismatch's line
    names (process 0 reading one copy, process 1 the other)."""
    import jax.sharding

    from nljax.run import startup

    cfg = config.load(None, [*RUN, f"data.eval_sets=[held={tmp_path}/held/*.jsonl,other={texts}/other/*.jsonl]"])
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    records = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # the check runs where there are several
    monkeypatch.setattr(startup, "agree", lambda what, record: records.append(record) or "0" * 64)

    def check():
        task = types.SimpleNamespace(fingerprint=lambda: "main", eval_sets=evalsets.load(cfg.data, cfg.train.seq_len))
        startup.check_startup(cfg, mesh, task, lambda line: None)
        return task

    shutil.copytree(texts / "held", tmp_path / "held")
    task = check()
    assert records[0]["data.eval_sets"] == {s.name: s.digest for s in task.eval_sets}
    shutil.copy(texts / "other" / "o.jsonl", tmp_path / "held" / "h.jsonl")  # the other set's text here
    check()
    assert records[1]["data.eval_sets"]["held"] == records[0]["data.eval_sets"]["other"]
    line = distributed.explain(records)
    assert line.startswith('data.eval_sets.held: process 0 = "' + records[0]["data.eval_sets"]["held"][:20]), line
    assert ";" not in line and f'process 1 = "{records[1]["data.eval_sets"]["held"][:20]}' in line


def test_a_change_to_the_sets_setting_restarts_no_row_and_is_silent():
    """data.eval_sets trains nothing (as eval.*): a resume with a set added neither restarts every
    row's memory (the ContextStream reads the same rows) nor warns of the setting; a set whose
    content changed is warned of by its digest instead (above)."""
    from nljax.checkpoint import restore

    saved = {"config": config.to_dict(config.load(None, RUN)), "step": 2}
    resumed = config.load(None, [*RUN, "data.eval_sets=[a=held/*.txt]"])
    assert restore._changed_settings(saved, resumed) == []
    warnings = []
    assert not restore._rows_restart(saved, resumed, {"memory/block0": None}, warnings) and warnings == []
    # what does restart them still does
    assert restore._rows_restart(saved, config.load(None, [*RUN, "seed=7"]), {"memory/block0": None}, warnings)


def test_a_resume_warns_of_a_set_left_out_and_notes_a_set_added(tmp_path, capsys):
    """The checkpoint's record of its sets against this run's (`Checkpoints.check_data`): a set
    the checkpoint scored that the config left out is one warning naming it (its curve stops; not
    an error: dropping a set is legitimate), a set added one note (its curve starts here), a
    set kept with the same text nothing. Checked on the method alone: no run is trained."""
    from nljax.checkpoint.lifecycle import Checkpoints
    from nljax.checkpoint.restore import Restored

    path = tmp_path / "checkpoints" / "3"
    ckpt = Checkpoints.__new__(Checkpoints)  # only what check_data reads
    ckpt.restored = Restored(None, 3, path, False, [], eval_sets={"kept": "a" * 64, "gone": "b" * 64})
    notes = []
    ckpt.check_data("d" * 64, {"kept": "a" * 64, "added": "c" * 64}, notes.append)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"nljax: warning: data.eval_sets gone was scored by checkpoint {path} but is no longer in "
                   "data.eval_sets: eval_loss/gone and its other scores in metrics.jsonl stop at this resume "
                   "(step 3)"], err
    assert notes == [f"note: data.eval_sets added is new since checkpoint {path}: eval_loss/added and its other "
                     "scores in metrics.jsonl start at this resume (step 3)"], notes
    assert ckpt.eval_sets == {"kept": "a" * 64, "added": "c" * 64}  # what the next save records
    # the same sets: nothing said
    ckpt.check_data("d" * 64, {"kept": "a" * 64, "gone": "b" * 64}, notes.append)
    assert capsys.readouterr().err == "" and len(notes) == 1


def test_a_set_of_one_window_is_the_shortest_taken(tmp_path):
    """A set must hold one window of train.seq_len + 1 tokens (inputs and their next tokens):
    seq_len + 1 is taken, seq_len refused."""
    for n, ok in ((8, False), (9, True)):  # bytes: n - 1 characters and the document's end
        (tmp_path / f"s{n}.txt").write_text("x" * (n - 1))
        d = config.load(None, [f"data.eval_sets=[s={tmp_path}/s{n}.txt]"]).data
        if ok:
            assert len(evalsets.load(d, 8)[0].tokens) == 9
        else:
            with pytest.raises(config.ConfigError, match="8 tokens in 1 file"):
                evalsets.load(d, 8)


def test_a_prepared_directory_is_a_set_of_its_held_out_split(texts, tokenizer, tmp_path):
    """A set may be a directory nljax.prepare wrote: its held-out split (memory-mapped; train.bin
    never opened) is the set, the same tokens, document ends, bits per byte and digest as the
    same text given as files; prepared with other token ids than the run's, damaged, or too
    short, it is one line naming the set."""
    from nljax.data import prepared

    prep = tmp_path / "prep"
    prepared.build(config.load(None, ["data.source=files", f"data.eval={texts}/other/*.jsonl",  # held-out alone
                                      f"data.tokenizer={tokenizer}"]).data, prep)
    (prep / "train.bin").unlink()  # an evaluation's reading: not opened (empty here)
    sets = lambda *extra: evalsets.load(config.load(None, [
        "data.source=files", f"data.train={texts}/train/*.jsonl", *extra,
        f"data.eval_sets=[files={texts}/other/*.jsonl, ready={prep}]"]).data, 8)
    files, ready = sets(f"data.tokenizer={tokenizer}")
    assert ready.name == "ready" and len(ready.tokens) > 9 and ready.tokens.tolist() == files.tokens.tolist()
    assert ready.ends.tolist() == files.ends.tolist() and ready.tokens_per_byte == files.tokens_per_byte < 1
    assert ready.digest == files.digest
    with pytest.raises(config.ConfigError) as e:  # the run reads bytes
        sets()
    sha = prepared.read_manifest(prep)["tokenizer"]["sha256"][:12]
    assert str(e.value) == (f"data.eval_sets ready: {prep} was prepared with the tokenizer of sha256 {sha}, the run's "
                            "text is byte tokens: its token ids would stand for other text")
    with pytest.raises(config.ConfigError) as e:
        evalsets.load(config.load(None, [f"data.tokenizer={tokenizer}", "data.source=files",
                                         f"data.train={texts}/train/*.jsonl", f"data.eval_sets=[ready={prep}]"]).data,
                      len(ready.tokens))
    assert str(e.value) == (f"data.eval_sets ready: {len(ready.tokens)} tokens in the held-out split of {prep}, "
                            f"shorter than train.seq_len+1={len(ready.tokens) + 1}: prepare it with a larger "
                            "data.eval_fraction")
    with pytest.raises(config.ConfigError) as e:  # its files globbed: the directory is what is read
        evalsets.load(config.load(None, [f"data.eval_sets=[ready={prep}/*]"]).data, 8)
    assert str(e.value).startswith(f"data.eval_sets ready: {prep}/") and str(e.value).endswith(
        f"; {prep} holds data nljax.prepare wrote: give the directory itself"), e.value
    (prep / "eval.bin").unlink()
    with pytest.raises(config.ConfigError) as e:
        sets(f"data.tokenizer={tokenizer}")
    assert str(e.value) == f"data.eval_sets ready: {prep}: eval.bin is missing (deleted or moved since): prepare again"


def test_a_sets_digest_covers_its_document_starts():
    """Two sets of the same token ids cut into documents otherwise (a tokenization without an
    end token: one file or two) are scored otherwise (each document starts from a fresh memory):
    their digests differ, as they do for other ids, byte counts or tokenizations."""
    rec = {"sha256": "ids", "docs_sha256": "starts", "tokens": 10, "bytes": 12}
    tok = {"kind": "tokenizers", "vocab_size": 3}
    digests = {evalsets.content_digest(rec, tok)}
    for other in ({"docs_sha256": "other starts"}, {"sha256": "other ids"}, {"tokens": 11}, {"bytes": 13}):
        digests.add(evalsets.content_digest({**rec, **other}, tok))
    digests.add(evalsets.content_digest(rec, {**tok, "vocab_size": 4}))
    assert len(digests) == 6
