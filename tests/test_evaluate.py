"""nljax.evaluate: a checkpoint's held-out metrics equal those its training run reported, on any
device count; other held-out files give other (finite) numbers; another tokenizer's data, and
bad input, are one line with nothing written."""

import dataclasses
import hashlib
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import QUICK, TINY, TINY_NL, saved_run

from nljax import config, evaluate, export
from nljax.data import prepared
from nljax.errors import ConfigError
from nljax.run.core import Run
from nljax.run.trainer import train
from nljax.runtime import resultfile

# a memory (so that the streaming evaluation carries something), evaluated after 2 steps and at
# the end (3), with checkpoints after 2 and 3; trained on a 2 x 4 mesh, one CMS level (one step
# variant to compile)
RUN = [*TINY, *TINY_NL, *QUICK, "cms.periods=[1]", "mesh.inter=2", "mesh.intra=4", "checkpoint.every=2", "eval.every=2",
       "eval.batches=1", "eval.stream_steps=2", "run.quiet=true", "train.steps=3"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("evaluate") / "run"
    train(config.load(None, [*RUN, f"run.dir={d}"]))
    return d


@pytest.fixture(scope="module")
def other_text(tmp_path_factory):
    """Held-out files of other text than the standard library's Python: English prose."""
    root = tmp_path_factory.mktemp("other")
    for i in range(3):
        (root / f"doc{i}.txt").write_text(f"Chapter {i}. The quick brown fox jumps over the lazy dog. " * 20)
    return root


def bpe_tokenizer(texts, path, vocab: int = 300):
    """A byte-level BPE tokenizer of `vocab` tokens trained here on `texts`, saved at `path` (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet))
    tok.save(str(path))
    return path


def text_and_tokenizer(root, docs: int, seed: int):
    """`docs` documents of 60 words in root/text/doc<i>.txt, and a BPE tokenizer trained on them
    (root/tok.json): (their texts, its path)."""
    words = "the a memory level stream token window model learns reads writes data file of and to".split()
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(words, 60)) + "." for _ in range(docs)]
    (root / "text").mkdir()
    for i, text in enumerate(texts):
        (root / "text" / f"doc{i}.txt").write_text(text)
    return texts, bpe_tokenizer(texts, root / "tok.json")


def result_of(argv, capsys) -> tuple[dict, dict]:
    """(the out= JSON, the metrics printed) of `nljax.evaluate argv` in this process."""
    capsys.readouterr()
    assert evaluate.main(argv) == 0
    captured = capsys.readouterr()
    # the seconds of reading the data and the checkpoint, then of compiling, are announced, on
    # standard error (standard output: the metrics alone)
    err = captured.err.splitlines()
    run = next(a.partition("=")[2] for a in argv if a.startswith("run.dir="))
    assert err[0] in (f"nljax.evaluate: reading the checkpoint of {run} and its held-out data ...",
                      f"nljax.evaluate: reading the export {run} and its held-out data ..."), err
    assert "nljax.evaluate: evaluating (compiling its step first) ..." in err
    printed = dict(line.split() for line in captured.out.splitlines())
    out = next(a.partition("=")[2] for a in argv if a.startswith("out="))
    with open(out) as f:
        return json.load(f), printed


def test_the_numbers_are_the_runs_own_on_any_device_count(run_dir, tmp_path, capsys):
    summary = json.loads((run_dir / "summary.json").read_text())
    reported = {k: v for k, v in summary.items() if k.startswith("eval_")}
    assert set(reported) == {"eval_loss", "eval_bpb", "eval_tokens", "eval_loss_stream", "eval_bpb_stream",
                             "eval_tokens_stream"}
    out = tmp_path / "final.json"
    result, printed = result_of([f"run.dir={run_dir}", f"out={out}"], capsys)  # the 8 devices, 1 x 8
    assert result["step"] == 3 and result["checkpoint"] == str(run_dir / "checkpoints" / "3")
    assert result["devices"] == 8 and result["data"] == summary["data"]
    for key, value in reported.items():
        assert result[key] == pytest.approx(value, rel=1e-6), key
        assert float(printed[key]) == result[key]  # printed in full
    # bits per token beside bits per byte: the same for byte tokens
    assert result["eval_bpt"] == pytest.approx(result["eval_loss"] / math.log(2)) == result["eval_bpb"]
    assert result["eval_bpt_stream"] == pytest.approx(result["eval_bpb_stream"])
    # the evaluation after 2 steps, logged in metrics.jsonl, from checkpoint 2 on one device: the
    # same numbers up to float reduction order
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after_2 = next(r for r in logged if "eval_loss" in r)
    assert after_2["step"] == 1  # the record of the second step
    t = evaluate.load(str(run_dir), 2, devices=jax.devices()[:1])
    early = evaluate.scores(t)
    assert t.step == 2 and t.run.engine.n_devices == 1
    for key in reported:
        assert early[key] == pytest.approx(after_2[key], rel=1e-5), key
    assert early["eval_loss"] != result["eval_loss"]
    # 3 devices: as many as divide the run's 8 rows (2)
    assert evaluate.load(str(run_dir), devices=jax.devices()[:3]).run.engine.n_devices == 2


def test_other_held_out_files_and_settings(run_dir, other_text, tmp_path, capsys):
    """data.eval alone scores those files (the run trained on the standard library's bytes), on 8
    and on 1 device alike; eval.batches and eval.stream_steps set how much is read."""
    base = json.loads((run_dir / "summary.json").read_text())  # on the run's own held-out text
    args = [f"run.dir={run_dir}", f"data.eval={other_text}/*.txt", "eval.batches=2", "eval.stream_steps=3"]
    out = tmp_path / "earlier.json"  # an earlier result (its keys): replaced
    out.write_text(json.dumps({"command": "python -m nljax.evaluate", "run_dir": "r", "checkpoint": "c", "step": 1}))
    other, _ = result_of([*args, f"out={out}"], capsys)
    assert other["command"] == "python -m nljax.evaluate " + " ".join([*args, f"out={out}"])
    assert other["data"]["source"] == "files" and other["data"]["eval_tokens"] == sum(
        len(p.read_bytes()) + 1 for p in other_text.glob("*.txt"))  # each document and its end (NUL)
    assert other["data"]["train_tokens"] == 0  # held-out text alone: no training text read
    assert other["eval_tokens"] == 2 * 8 * 8 and other["eval_tokens_stream"] == 3 * 8 * 8
    for key in ("eval_loss", "eval_bpb", "eval_loss_stream"):
        assert np.isfinite(other[key]) and other[key] != base[key], key
    one = evaluate.scores(evaluate.load(str(run_dir), overrides=args[1:], devices=jax.devices()[:1]))
    assert one["eval_loss"] == pytest.approx(other["eval_loss"], rel=1e-5)
    assert one["eval_loss_stream"] == pytest.approx(other["eval_loss_stream"], rel=1e-5)


def test_an_export_is_scored_as_the_checkpoint_it_came_from(run_dir, other_text, tmp_path, capsys):
    """run.dir=EXPORT: the numbers of the checkpoint it was exported from, on its run's held-out
    text and on other files; a bfloat16 export's are those of the parameters rounded to bfloat16;
    checkpoint=, params= and the keys the tool sets are one line."""
    exp, half = tmp_path / "export", tmp_path / "half"
    assert export.main([f"run.dir={run_dir}", f"out={exp}"]) == 0
    assert export.main([f"run.dir={run_dir}", f"out={half}", "dtype=bfloat16"]) == 0
    own, _ = result_of([f"run.dir={run_dir}", f"out={tmp_path / 'own.json'}"], capsys)
    got, printed = result_of([f"run.dir={exp}", f"out={tmp_path / 'exp.json'}"], capsys)
    assert got["export"] == str(exp) and got["checkpoint"] == own["checkpoint"] == str(run_dir / "checkpoints" / "3")
    assert got["step"] == 3 and got["devices"] == own["devices"] == 8 and got["data"] == own["data"]
    scored = [k for k in own if k.startswith("eval_")]
    assert scored and {k: got[k] for k in scored} == {k: own[k] for k in scored}
    # other held-out files, on one device: as the run's checkpoint scores them
    args = [f"data.eval={other_text}/*.txt", "eval.batches=2"]
    one = lambda d: evaluate.scores(evaluate.load(str(d), overrides=args, devices=jax.devices()[:1]))
    theirs, mine = one(run_dir), one(exp)
    assert mine == pytest.approx(theirs, rel=1e-6) and mine["eval_loss"] != got["eval_loss"]
    # bfloat16: the run's parameters rounded, computed in the model's float32
    t = evaluate.load(str(run_dir))
    rounded = jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(p.dtype), t.params)
    want = evaluate.scores(dataclasses.replace(t, params=rounded))
    assert evaluate.scores(evaluate.load(str(half))) == pytest.approx(want, rel=1e-6)
    assert want["eval_loss"] != own["eval_loss"]
    for args, line in [(["checkpoint=2"], f"{exp} is an export (one set of parameters): checkpoint= and params= are "
                                           "for a run directory"),
                       (["params=trained"], "checkpoint= and params= are for a run directory"),
                       (["mesh.intra=2"], "mesh.intra= cannot be overridden here: the export is read onto this "
                                          "process's devices, replicated")]:
        capsys.readouterr()
        assert evaluate.main([f"run.dir={exp}", *args, f"out={tmp_path / 'no.json'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("nljax.evaluate: error: ") and line in err[0], err
        assert not (tmp_path / "no.json").exists()


@pytest.mark.slow
def test_a_tokenizer_runs_export_reads_with_its_own_copy(tmp_path, capsys):
    """An export of a run on data.tokenizer's files scores that run's held-out text with the
    export's copy of the tokenizer (the run's file since deleted) as the run scored it, other files
    too; data of another tokenizer is one line naming the export."""
    texts, tok = text_and_tokenizer(tmp_path, 6, seed=1)
    run = tmp_path / "run"
    train(config.load(None, [*TINY, *QUICK, "cms.periods=[1]", "train.steps=1", "eval.batches=1", "run.quiet=true",
                             f"run.dir={run}", "data.source=files", f"data.train={tmp_path}/text/*.txt",
                             f"data.tokenizer={tok}", "data.eval_fraction=0.5"]))
    assert export.main([f"run.dir={run}", f"out={tmp_path / 'exp'}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    tok.rename(tmp_path / "gone.json")
    got, _ = result_of([f"run.dir={tmp_path / 'exp'}", f"out={tmp_path / 'r.json'}"], capsys)
    assert got["data"] == summary["data"] and got["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-6)
    other, _ = result_of([f"run.dir={tmp_path / 'exp'}", f"data.eval={tmp_path}/text/doc0.txt",
                          f"out={tmp_path / 'o.json'}"], capsys)
    assert other["data"]["train_tokens"] == 0 and np.isfinite(other["eval_loss"])
    # another tokenizer, of a smaller vocabulary or a larger one (refused as "model.vocab_size=N is
    # smaller than the M tokens of the tokenizer's vocabulary; leave it at 256")
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()[:12]
    size = lambda p: len(json.loads(p.read_text())["model"]["vocab"])
    larger = bpe_tokenizer(texts, tmp_path / "more.json", vocab=400)
    assert size(larger) > size(tmp_path / "exp" / "tokenizer.json")
    for other_tok in (bpe_tokenizer(texts[:2], tmp_path / "other.json"), larger):
        capsys.readouterr()
        assert evaluate.main([f"run.dir={tmp_path / 'exp'}", f"data.eval={tmp_path}/text/doc0.txt",
                              f"data.tokenizer={other_tok}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"nljax.evaluate: error: export {tmp_path / 'exp'} was trained on the tokenizer of sha256 "
                       f"{sha(tmp_path / 'gone.json')}, the data now use the tokenizer of sha256 {sha(other_tok)}: "
                       "its token ids would stand for other text"], err
        # the run itself, as its checkpoint (the larger vocabulary was the model.vocab_size line too)
        assert evaluate.main([f"run.dir={run}", f"data.eval={tmp_path}/text/doc0.txt",
                              f"data.tokenizer={other_tok}"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"nljax.evaluate: error: checkpoint {run / 'checkpoints' / '1'} was trained on the tokenizer of sha256 "
            f"{sha(tmp_path / 'gone.json')}, the run's data now use the tokenizer of sha256 {sha(other_tok)}: "
            "its token ids would stand for other text")
    # the run's tokenizer gone: data.eval= does not replace it (the line said it did)
    assert evaluate.main([f"run.dir={run}", f"data.eval={tmp_path}/text/doc0.txt"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"nljax.evaluate: error: data.tokenizer: cannot read {tok}: No such file or directory (the run's tokenizer, "
        "as its config.yaml names it: give data.tokenizer= where it is now)")
    # the run's text moved away, no data named: the line says what the export (and the run) read
    (tmp_path / "text").rename(tmp_path / "moved")
    for d, names in ((tmp_path / "exp", "config.json"), (run, "config.yaml")):
        assert evaluate.main([f"run.dir={d}"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"nljax.evaluate: error: data.train: '{tmp_path}/text/*.txt' matches no file (the run's own held-out data, "
            f"as its {names} names them: give data.eval= to score others)")
    # the export's copy of the tokenizer gone: the export's line, as nljax.generate's
    (tmp_path / "exp" / "tokenizer.json").unlink()
    for given in ([], [f"data.eval={tmp_path}/moved/doc0.txt"]):
        assert evaluate.main([f"run.dir={tmp_path / 'exp'}", *given]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"nljax.evaluate: error: the export {tmp_path / 'exp'}: tokenizer.json cannot be read (No such file or "
            "directory)")


def test_another_held_out_split_than_the_runs_is_warned_of(run_dir, other_text):
    """data.eval_fraction= other than the run's scores other held-out text than the run scored
    (in silence before): one warning naming the key and both values. Where it cuts nothing (other
    files, data.eval), or nothing is read (a text model loaded to sample), none."""
    from nljax.run import trained

    one = jax.devices()[:1]
    t = evaluate.load(str(run_dir), overrides=["data.eval_fraction=0.1"], devices=one)
    assert t.warnings("nljax.evaluate") == [
        f"nljax.evaluate: warning: data.eval_fraction=0.1 holds out other examples than the run's (0.05 in "
        f"{run_dir / 'config.yaml'}): the held-out data are not those the run was scored on"]
    assert evaluate.load(str(run_dir), overrides=["data.eval_fraction=0.05"], devices=one).warnings("x") == []
    # another fraction that makes the same split (every 20th: round(1/0.051) == round(1/0.05)): no warning
    assert evaluate.load(str(run_dir), overrides=["data.eval_fraction=0.051"], devices=one).warnings("x") == []
    assert evaluate.load(str(run_dir), overrides=[f"data.eval={other_text}/*.txt", "data.eval_fraction=0.1"],
                         devices=one).warnings("x") == []
    assert trained.load(run_dir, overrides=["data.eval_fraction=0.1"], devices=one).warnings("x") == []


def test_data_of_another_tokenizer_is_refused(run_dir, other_text, tmp_path, capsys):
    bpe_tokenizer([p.read_text() for p in other_text.glob("*.txt")], tmp_path / "tokenizer.json")
    capsys.readouterr()
    out = tmp_path / "r.json"
    assert evaluate.main([f"run.dir={run_dir}", f"data.eval={other_text}/*.txt",
                          f"data.tokenizer={tmp_path / 'tokenizer.json'}", f"out={out}"]) == 2
    # found once the checkpoint is read: one line, after the one saying it is being read
    reading, err = capsys.readouterr().err.strip().split("\n")
    assert reading == f"nljax.evaluate: reading the checkpoint of {run_dir} and its held-out data ..."
    assert err.startswith(f"nljax.evaluate: error: checkpoint {run_dir / 'checkpoints' / '3'} "
                          "was trained on byte tokens, the run's data now use the tokenizer of sha256 "), err
    assert not out.exists()


def test_a_relative_glob_of_the_command_line_is_not_blamed_on_config_yaml(run_dir, tmp_path, monkeypatch, capsys):
    """data.eval=held/*.txt matching nothing here: the line said that data.eval in the run's
    config.yaml was relative to where the run started, a value the command line had just given."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert evaluate.main([f"run.dir={run_dir}", "data.eval=held/*.txt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "nljax.evaluate: error: data.eval: 'held/*.txt' matches no file", err


def test_a_section_the_tools_set_given_whole_is_refused(run_dir):
    """From Python (the command line takes dotted keys only), mesh={model: 2} was merged into the
    mesh the tools set and lost in silence, as mesh.model=2 was."""
    from nljax.run import trained

    with pytest.raises(ConfigError, match="^mesh= cannot be overridden here"):
        trained.config_of(run_dir, overrides=["mesh={model: 2}"])


@pytest.mark.parametrize("args,line", [
    (["run.dir={d}/nowhere"], "{d}/nowhere/config.yaml not found: run.dir must be a run directory written by "
                              "nljax.train"),
    (["run.dir={d}/empty"], "checkpoint not found: {d}/empty/checkpoints"),
    (["run.dir={run}", "data.eval={d}/nothing/*.txt"], "data.eval: '{d}/nothing/*.txt' matches no file"),
    # held-out files of no text: the line named data.train, which was not given
    (["run.dir={run}", "data.eval={d}/blank.txt"], "data.eval: no text in 1 file(s) (every document empty)"),
    (["run.dir={run}", "eval.batchez=2"], "unknown config key 'eval.batchez' (did you mean 'eval.batches'?)"),
    (["run.dir={run}", "checkpoint=7"], "checkpoint=7: {run} has no checkpoint at step 7 (its checkpoints are at "
                                        "steps 2, 3)"),
    # a word or a file taken for a path: "checkpoint not found: $PWD/abc", "no complete checkpoint in FILE"
    (["run.dir={run}", "checkpoint={d}/abc"], "checkpoint={d}/abc is not latest, a step number or an existing path "
                                             "({d}/abc not found): give latest (the default), a step number, a step "
                                             "directory or a folder of checkpoints"),
    (["run.dir={run}", "checkpoint={d}/theirs.json"], "checkpoint={d}/theirs.json is a file: give latest"),
    (["run.dir={run}", "out={d}/r.txt"], "out={d}/r.txt: the result is JSON, give a file name ending in .json"),
    (["run.dir={run}", "out={d}/theirs.json"], "out={d}/theirs.json holds a file that is not an nljax.evaluate "
                                               "result: give a new file name, or move it"),
    # under a file, or under a link to nothing: mkdir's "File exists" once the checkpoint was scored
    (["run.dir={run}", "out={d}/theirs.json/r.json"], "out={d}/theirs.json/r.json: {d}/theirs.json is a file, not a "
                                                      "directory"),
    (["run.dir={run}", "out={d}/gone/sub/r.json"], "out={d}/gone/sub/r.json: {d}/gone is a symbolic link to "
                                                   "{d}/nowhere, which does not exist"),
    (["out={d}/r.json"], "run.dir=DIR is required: the run directory nljax.train wrote"),
    # empty: a fresh start's checkpoint.resume (an AssertionError's traceback), the working directory
    (["run.dir={run}", "checkpoint="], "checkpoint= is empty: give latest (the default), a step number or a step "
                                       "directory"),
    (["run.dir="], "run.dir= is empty: give the run directory nljax.train wrote"),
    # keys the command sets itself, which won over the command line's in silence
    (["run.dir={run}", "mesh.intra=2", "checkpoint.resume={run}/checkpoints/2"],
     "checkpoint.resume=, mesh.intra= cannot be overridden here: the checkpoint is read onto this process's devices, "
     "replicated (checkpoint= chooses which one)"),
])
def test_bad_input_is_one_line_and_writes_nothing(args, line, run_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    shutil.copy(run_dir / "config.yaml", tmp_path / "empty" / "config.yaml")  # a run that saved no checkpoint
    (tmp_path / "theirs.json").write_text('{"a user": "file"}')
    (tmp_path / "blank.txt").write_text("")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    tree = lambda root: sorted((p.relative_to(root), p.lstat().st_mtime_ns) for p in root.rglob("*"))
    before = tree(tmp_path), tree(run_dir)
    capsys.readouterr()
    argv = [a.format(d=tmp_path, run=run_dir) for a in args]
    assert evaluate.main([*argv, *([] if any(a.startswith("out=") for a in argv) else [f"out={tmp_path}/r.json"])]) == 2
    # one line: after the line saying the checkpoint is being read where it is found there
    *reading, err = capsys.readouterr().err.splitlines()
    assert reading in ([], [f"nljax.evaluate: reading the checkpoint of {argv[0].partition('=')[2]} and its "
                            "held-out data ..."]), reading
    assert err.startswith("nljax.evaluate: error: ") and line.format(d=tmp_path, run=run_dir) in err, err
    assert (tree(tmp_path), tree(run_dir)) == before
    assert (tmp_path / "theirs.json").read_text() == '{"a user": "file"}'


def test_the_result_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    resultfile.write(out, {"command": "first", "run_dir": "r", "checkpoint": "c", "step": 1})
    assert resultfile.earlier_result(out, evaluate.RESULT_KEYS)

    def full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(resultfile.os, "replace", full)
    with pytest.raises(OSError):
        resultfile.write(out, {"command": "second"})
    assert json.loads(out.read_text())["command"] == "first" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_prepared_run_is_scored_from_its_held_out_split_alone(tmp_path, capsys, monkeypatch):
    """A run on a data.prepared directory (with a tokenizer) is scored from the manifest, the
    tokenizer copy and eval.bin: train.bin is neither opened nor hashed (some 25 s per 10B
    tokens), and may be gone; the numbers and the data record are the run's own."""
    texts, tok = text_and_tokenizer(tmp_path, 8, seed=0)
    prep = tmp_path / "prep"
    prepared.build(config.load(None, ["data.source=files", f"data.train={tmp_path}/text/*.txt", f"data.tokenizer={tok}",
                                      "data.eval_fraction=0.5"]).data, prep)
    run = tmp_path / "run"
    train(config.load(None, [*TINY, *QUICK, "cms.periods=[1]", "train.steps=2", "eval.batches=1",
                             "eval.stream_steps=1", "run.quiet=true", f"run.dir={run}", "data.source=files",
                             f"data.prepared={prep}"]))
    summary = json.loads((run / "summary.json").read_text())
    reported = {k: v for k, v in summary.items() if k.startswith("eval_")}
    assert {"eval_loss", "eval_loss_stream"} <= reported.keys()
    monkeypatch.setattr(prepared, "_CACHE", {})  # as in a process of its own: the run's corpus is not at hand
    hashed, real = [], prepared._check_tokens  # every token file a load opens is hashed in full first
    monkeypatch.setattr(prepared, "_check_tokens", lambda path, file, *a: (hashed.append(file.name),
                                                                          real(path, file, *a)))
    result, _ = result_of([f"run.dir={run}", f"out={tmp_path / 'r.json'}"], capsys)
    assert hashed == ["eval.bin"]
    for name in ("train.bin", "train.docs.npy"):  # moved away, or deleted to save the space
        (prep / name).unlink()
    gone, _ = result_of([f"run.dir={run}", f"out={tmp_path / 'gone.json'}"], capsys)
    for r in (result, gone):
        assert r["data"] == summary["data"] and r["data"]["train_tokens"] > 0  # the manifest's count
        for key, value in reported.items():
            assert r[key] == pytest.approx(value, rel=1e-6), key
    with pytest.raises(ConfigError, match="train.bin is missing"):  # a run that trains needs it
        Run.create(config.load(None, [*TINY, "data.source=files", f"data.prepared={prep}"]))
    # data.eval alone: those files, tokenized with the directory's copy of the tokenizer (the
    # source text moved away too)
    shutil.move(tmp_path / "text", tmp_path / "moved")
    hashed.clear()
    other, _ = result_of([f"run.dir={run}", f"data.eval={tmp_path}/moved/doc0.txt", f"out={tmp_path / 'o.json'}"],
                         capsys)
    assert other["data"]["train_tokens"] == 0 and other["eval_loss"] != result["eval_loss"]
    assert hashed == []  # no token file of the directory
    # a run that named the directory's source text too (one config to prepare and to train):
    # that text, moved away, is not looked for
    monkeypatch.setattr(prepared, "_CACHE", {})
    with_sources = [f"run.dir={run}", f"data.train={tmp_path}/text/*.txt", f"data.tokenizer={tok}",
                    f"data.prepared={prep}", "data.eval_fraction=0.5"]
    also, _ = result_of([*with_sources, f"out={tmp_path / 'a.json'}"], capsys)
    assert also["eval_loss"] == result["eval_loss"]


def test_held_out_files_alone_train_nothing(other_text, run_dir, tmp_path, capsys):
    """data.eval alone is held-out text only: every document scored, refused by a run that trains;
    nljax.prepare makes of it a directory of held-out text only (an empty training split), which
    nljax.evaluate scores as it scores the files, and a run refuses to train on."""
    from nljax.prepare import main as prepare_main

    cfg = config.load(None, [*TINY, "data.source=files", f"data.eval={other_text}/*.txt"])
    c = prepared.corpus(cfg.data)
    assert c.eval.tokens.tobytes() == b"".join(p.read_bytes() + b"\0" for p in sorted(other_text.glob("*.txt")))
    with pytest.raises(ConfigError, match=r"data.eval alone is held-out text only \(for nljax.evaluate\): training "
                                          r"needs data.train"):
        Run.create(cfg)
    with pytest.raises(ConfigError, match="preparing needs data.train"):  # in memory: nowhere to keep it
        prepared.build(cfg.data)
    prep = tmp_path / "prep"
    capsys.readouterr()
    assert prepare_main([f"data.eval={other_text}/*.txt", f"out={prep}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"nljax.prepare: score it beside a run's held-out text with data.eval_sets=[NAME={prep}], or alone with "
        f"python -m nljax.evaluate run.dir=RUN data.prepared={prep}")
    ready = prepared.load(prep)
    assert len(ready.train.tokens) == 0 and ready.eval.tokens.tolist() == c.eval.tokens.tolist()
    assert ready.eval.starts.tolist() == c.eval.starts.tolist()
    args = ["eval.batches=0"]
    files = evaluate.scores(evaluate.load(str(run_dir), overrides=[*args, f"data.eval={other_text}/*.txt"]))
    assert evaluate.scores(evaluate.load(str(run_dir), overrides=[*args, f"data.prepared={prep}"])) == files
    with pytest.raises(ConfigError) as e:
        Run.create(config.load(None, [*TINY, "data.source=files", f"data.prepared={prep}"]))
    assert str(e.value) == (f"data.prepared={prep} holds held-out text only (prepared from data.eval alone): nothing "
                            f"to train on; score it as a held-out set, data.eval_sets=[NAME={prep}]")


def test_an_image_model_reports_its_tasks_evaluation(tmp_path):
    """A MeanFlow run: the energy distances (and error) its evaluation reports, and no sample grid
    written into the run directory."""
    dit = ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
           "model.dit.patch_size=1", "images.source=moons", "images.toy_points=80", "cms.periods=[1]",
           "train.batch_size=16", "meanflow.sample_steps=2"]
    setup, state = saved_run(tmp_path / "run", dit, 1, 2, steps=1)  # trained: the DiT's output is zero at init
    want = setup.run.evaluate(state.params, 1)
    # the names and each file's time: the run's own grid of this step (samples_000001.png) stays as it was
    written = lambda: {p.name: p.stat().st_mtime_ns if p.is_file() else None for p in (tmp_path / "run").iterdir()}
    before = written()
    got = evaluate.scores(evaluate.load(str(tmp_path / "run")))
    assert set(got) == set(want) and got["eval_energy_1step"] != got["eval_energy_multistep"]
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4), key
    assert written() == before
    assert export.main([f"run.dir={tmp_path / 'run'}", f"out={tmp_path / 'exp'}"]) == 0  # its export: the same
    assert evaluate.scores(evaluate.load(str(tmp_path / "exp"))) == pytest.approx(got, rel=1e-6)
    # the images named, as a text run's data are: at start-up, in summary.json and in evaluate's header
    from nljax.run import trainer

    data = setup.run.task.data
    d = setup.run.task.describe()
    assert d == {"source": "moons", "train_images": len(data.train_x), "eval_images": len(data.eval_x),
                 "shape": list(data.train_x.shape[1:]), "num_classes": data.num_classes,
                 "digest": setup.run.task.fingerprint()}
    said = []
    trainer.startup_report(setup.run, state, said.append)
    shape = "x".join(map(str, data.train_x.shape[1:]))
    unconditional = " (unconditional)" if not data.num_classes else ""
    assert (f"images moons: {len(data.train_x):,} training and {len(data.eval_x):,} held-out, {shape}, classes "
            f"{data.num_classes}{unconditional}, digest {d['digest'][:12]}") in said
    assert evaluate._data(evaluate.load(str(tmp_path / "run"))) == (
        f", images moons ({len(data.eval_x):,} held-out, digest {d['digest'][:12]})")


def test_which_data_keys_other_held_out_data_implies(tmp_path):
    """data.eval alone: those files, with the tokenizer the run trained with (here the copy in its
    data.prepared directory, its end token quoted); data.prepared alone: that directory, the run's
    file keys dropped; data.train given: the overrides as they are."""
    import yaml

    prep = tmp_path / "prep"
    prep.mkdir()
    (prep / "manifest.json").write_text(json.dumps({"tokenizer": {"kind": "tokenizers", "file": "tokenizer.json",
                                                                  "doc_end_token": "[EOS]"}}))
    run = tmp_path / "run"
    run.mkdir()
    cfg = config.load(None, [*TINY, "data.source=files", f"data.prepared={prep}"])
    (run / "config.yaml").write_text(yaml.safe_dump(config.to_dict(cfg), sort_keys=False))
    held = evaluate.data_overrides(str(run), ["data.eval=x/*.txt"])
    assert held == ["data.source=files", "data.train=[]", "data.prepared=", f"data.tokenizer={prep / 'tokenizer.json'}",
                    'data.doc_end_token="[EOS]"', "data.eval=x/*.txt"]
    d = config.load(None, [*TINY, *held]).data
    assert (d.train, d.eval, d.prepared, d.doc_end_token) == ((), ("x/*.txt",), "", "[EOS]")
    assert evaluate.data_overrides(str(run), ["data.prepared=p", "eval.batches=2"]) == [
        "data.source=files", "data.train=[]", "data.eval=[]", "data.tokenizer=", "data.doc_end_token=",
        "data.eval_fraction=0.05", "data.prepared=p", "eval.batches=2"]
    assert evaluate.data_overrides(str(run), ["data.train=a", "data.eval=b"]) == ["data.train=a", "data.eval=b"]
    # prepared from .jsonl files' "content" field (the run's config.yaml holds the default key:
    # it was prepare's): other files are read by it, unless the command line gives one
    (prep / "manifest.json").write_text(json.dumps({"tokenizer": {"kind": "bytes"}, "settings": {"text_key": "content"}}))
    assert evaluate.data_overrides(str(run), ["data.eval=x.jsonl"]) == [
        "data.source=files", "data.train=[]", "data.prepared=", 'data.text_key="content"', "data.eval=x.jsonl"]
    assert config.load(None, [*TINY, 'data.text_key="content"']).data.text_key == "content"
    assert evaluate.data_overrides(str(run), ["data.eval=x.jsonl", "data.text_key=body"]) == [
        "data.source=files", "data.train=[]", "data.prepared=", "data.eval=x.jsonl", "data.text_key=body"]


def test_what_replaces_the_runs_own_data_gone_since(tmp_path):
    """A refusal of the run's own data, named by no one on the command line, says the key that
    scores others: data.eval= for its held-out text, but its tokenizer and its data.eval_sets are
    not replaced by data.eval= (the line said so, and data.eval= failed the same way)."""
    import yaml

    run = tmp_path / "run"
    run.mkdir()
    cfg = config.load(None, [*TINY, "data.source=files", "data.train=t/*.txt", "data.eval_sets=[h=h/*.txt]"])
    (run / "config.yaml").write_text(yaml.safe_dump(config.to_dict(cfg), sort_keys=False))
    hint = lambda line, *given: evaluate._gone_hint(line, given, str(run))
    assert hint("data.train: 't/*.txt' matches no file") == (
        "the run's own held-out data, as its config.yaml names them: give data.eval= to score others")
    assert hint("data.eval_sets h: 'h/*.txt' matches no file") == hint("data.eval_sets h: ...", "data.eval=x") == (
        "the run's own held-out sets, as its config.yaml names them: give data.eval_sets= to score others, [] for none")
    assert hint("data.tokenizer: cannot read tok.json: No such file or directory", "data.eval=x") == (
        "the run's tokenizer, as its config.yaml names it: give data.tokenizer= where it is now")
    assert hint("data.train: ...", "data.eval=x") is hint("data.eval_sets h: ...", "data.eval_sets=[]") is None
    assert hint("data.tokenizer: ...", "data.tokenizer=t.json") is hint("checkpoint 3 not found") is None


def test_held_out_data_of_the_other_kind_is_refused(tmp_path, capsys):
    """A MeanFlow run's data.eval= (text) and a language model's images.path= were ignored: the
    run's own held-out data scored, exit 0. Refused from the config alone, before any load."""
    import yaml

    for name, settings, given, line in [
        ("dit", ["model.name=dit", "cms.periods=[1]"], "data.eval=essays/*.txt",
         "data.eval= is text data, and this run's model is dit: its held-out images are images.* (images.path=...)"),
        ("text", TINY, "images.path=pics.npz",
         "images.path= is image data, and this run's model is cms_mlp: it reads text (data.eval=, ...)"),
    ]:
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump(config.to_dict(config.load(None, settings)), sort_keys=False))
        capsys.readouterr()
        assert evaluate.main([f"run.dir={run}", given]) == 2
        assert capsys.readouterr().err == f"nljax.evaluate: error: {line}\n"
