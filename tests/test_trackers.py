"""Trackers (nljax/run/trackers.py) and the samples of train.sample_every (nljax/run/samples.py): what a
run sends to TensorBoard and W&B (offline: files only, no network), a resume continuing the
same W&B run, and the one-line errors."""

import json
import logging
import math
import shutil
import sys
import time
import types

import numpy as np
import pytest
import yaml
from helpers import TINY, cli, make

from nljax import config
from nljax.engine import optim
from nljax.engine.conductor import Conductor
from nljax.errors import ConfigError
from nljax.run.samples import TrainingSampler, sample_line
from nljax.run.sampling import TextSampler, tokenization_of, write_text
from nljax.run.trackers import TensorBoard, Trackers, check_installed
from nljax.run.trainer import Output, train, train_loop
from nljax.runtime import runlog
from nljax.runtime.rundir import RunDir

QUICK = ["throughput.reps=1", "throughput.split=false", "run.plots=false", "run.compile_cache=none", "eval.batches=1",
         "eval.stream_steps=0"]


def events(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_gets_grad_norm_lr_skips_firing_and_the_samples(tmp_path, capsys):
    """Every step's train/grad_norm (the fired levels' norms together), train/lr (the schedule at
    the step, warm-up included), train/skipped and train/fired_l<l> (the Pulse), read back from
    the event files; a sample after steps 2 and 4, printed and logged as text, the last one what
    nljax.generate's sampler gives from the final parameters."""
    setup = make(["cms.periods=[1,2]", "train.steps=4", "train.sample_every=2", "train.sample_tokens=5",
                  "train.sample_prompt='def '", "eval.every=0", "optim.schedule=cosine", "optim.warmup_steps=2"], 1, 2)
    out = Output(RunDir(str(tmp_path), False, write=True), runlog.Progress(4, 0, 1, quiet=False),
                 Trackers([TensorBoard(tmp_path)]))
    state, _ = train_loop(setup.run, setup.state, Conductor((1, 2)), out)
    out.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    acc = events(tmp_path)
    values = lambda tag: [e.value for e in acc.Scalars(f"train/{tag}")]
    assert [e.step for e in acc.Scalars("train/grad_norm")] == [1, 2, 3, 4]  # steps done
    assert values("fired_l0") == [1, 1, 1, 1] and values("fired_l1") == [1, 0, 1, 0]
    assert values("skipped") == [0, 0, 0, 0]
    assert [e.step for e in acc.Scalars("train/grad_norm_l1")] == [1, 3]  # a level's norm when it fired
    lr = optim.schedule(setup.cfg.optim, 4, setup.cfg.train.batch_size)
    np.testing.assert_allclose(values("lr"), [float(lr(s + 1)) for s in range(4)], rtol=1e-6)
    assert values("lr")[0] < values("lr")[1]  # warm-up
    # each step's model FLOP/s (nljax.run.throughput.StepRates), as its record has it; no peak on
    # a CPU without throughput.peak_tflops: no MFU, rather than a 0
    np.testing.assert_allclose(values("tflops_per_s_per_device"), [r["tflops_per_s_per_device"] for r in records],
                               rtol=1e-6)
    assert all(v > 0 for v in values("tflops_per_s_per_device"))
    assert "train/mfu" not in acc.Tags()["scalars"] and not any("mfu" in r for r in records)
    norms = [math.hypot(r["grad_norm_l0"], r.get("grad_norm_l1", 0.0)) for r in records]
    np.testing.assert_allclose(values("grad_norm"), norms, rtol=1e-5)
    assert all(n > 0 for n in norms)

    printed = [l for l in capsys.readouterr().out.splitlines() if "sample:" in l]
    assert [l.split()[1] for l in printed] == ["1", "3"]  # after 2 and 4 steps
    texts = [json.JSONDecoder().raw_decode(l.split("sample: ", 1)[1])[0] for l in printed]  # "(ended ...)" after
    assert [e.step for e in acc.Tensors("train/sample/text_summary")] == [2, 4]
    logged = acc.Tensors("train/sample/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert logged == "\n".join("    " + line for line in texts[-1].split("\n"))
    sampler = TextSampler(setup.engine.model, state.params, setup.mesh, setup.cfg.train.seq_len, 0,
                          vocab=setup.cfg.model.vocab_size)  # bytes: NUL ends a document
    settings = TrainingSampler(setup.run).settings  # nljax.generate's defaults, the run's seed
    assert (settings.prompt, settings.max_new_tokens, settings.seed) == ("def ", 5, setup.cfg.seed)
    written = []  # nljax.generate's text (prompt=): to its document end, if the model samples one
    write_text(sampler, tokenization_of(setup.cfg), settings, written.append)
    assert texts[-1] == "".join(written)


def test_a_training_sample_ends_at_the_document_end():
    """A sample ends, as nljax.generate's text does by default, at the document-end token (bytes:
    NUL), which is not shown, and the tokens after it are not drawn; it ran on into the next
    document. Without one it is the prompt and every token. The model is scripted: no forward."""
    cfg = config.load(None, ["train.sample_every=1", "train.sample_tokens=6", "train.sample_prompt=ab"])
    strategy = types.SimpleNamespace(gather_params=lambda params: params)
    sampler = TrainingSampler(types.SimpleNamespace(cfg=cfg, engine=types.SimpleNamespace(strategy=strategy)))
    drawn = []

    class Scripted:  # TextSampler's tokens, from a script
        params = None

        def __init__(self, script):
            self.script = script

        def tokens(self, prompt, settings):
            assert prompt == list(b"ab") and settings.max_new_tokens == 6
            for token in self.script[: settings.max_new_tokens]:
                drawn.append(token)
                yield token

    sampler._sampler = Scripted(b"cd\0efg")
    assert sampler.sample({}) == ("abcd", "eos") and drawn == list(b"cd\0")
    sampler._sampler = Scripted(b"cdefgh\0")
    assert sampler.sample({}) == ("abcdefgh", "length")


def test_the_sample_line_says_a_sample_ended_at_the_document_end():
    """The console line of a sample (the trainer's `train.sample_every` hook prints it): one that
    stopped at the document end says so after the text, so that a short sample is not taken for
    one cut off; one that ran its train.sample_tokens says nothing more. The sampler is scripted
    (no model): the line is made from what `TrainingSampler.sample` returns."""
    cfg = config.load(None, ["train.sample_every=1", "train.sample_tokens=4", "train.sample_prompt=ab"])
    strategy = types.SimpleNamespace(gather_params=lambda params: params)
    sampler = TrainingSampler(types.SimpleNamespace(cfg=cfg, engine=types.SimpleNamespace(strategy=strategy)))
    script = lambda tokens: types.SimpleNamespace(params=None, tokens=lambda prompt, settings: iter(tokens))
    sampler._sampler = script(b'c"\0de')  # a quote, shown as JSON writes it
    assert sample_line(3, *sampler.sample({})) == 'step      3  sample: "abc\\""  (ended at the document end)'
    sampler._sampler = script(b"cdef")
    assert sample_line(3, *sampler.sample({})) == 'step      3  sample: "abcdef"'


def test_tensorboard_after_a_resume_holds_each_step_once(tmp_path):
    """Run 6 steps (evaluations and checkpoints after 2, 4, 6), lose checkpoints 4 and 6, resume
    from 2: the event files hold every step's scalars once and the evaluations after 2, 4 and 6
    steps, with the values of the uninterrupted run. The evaluation at the checkpoint's step used
    to be purged with the steps run again (it is not redone)."""
    import shutil

    d = tmp_path / "run"
    common = [*TINY, *QUICK, "cms.periods=[1]", "mesh.inter=1", "mesh.intra=8", "checkpoint.every=2", "eval.every=2",
              f"run.dir={d}", "run.quiet=true", "train.steps=6"]
    train(config.load(None, common))
    whole = events(d)
    scalars = lambda acc, tag: [(e.step, e.value) for e in acc.Scalars(tag)]
    assert [s for s, _ in scalars(whole, "eval/eval_loss")] == [2, 4, 6]
    for step in ("4", "6"):
        shutil.rmtree(d / "checkpoints" / step)
    train(config.load(None, [*common, "checkpoint.resume=latest"]))
    train(config.load(None, [*common, "checkpoint.resume=latest"]))  # from step 6: nothing to run, nothing logged again
    # as read by the legacy loader and by TensorBoard's server (the plugin loader, which takes a
    # run's first session start as its start: a fresh run's file used to have none, so the
    # resume's start purged nothing there and the steps after 2 showed twice)
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.util import tensor_util

    plugin = plugin_event_accumulator.EventAccumulator(str(d), size_guidance={"tensors": 0})
    plugin.Reload()
    as_served = lambda tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in plugin.Tensors(tag)]
    for read in (lambda tag: scalars(events(d), tag), as_served):
        for tag in ("eval/eval_loss", "train/loss", "train/grad_norm"):
            assert [s for s, _ in read(tag)] == [s for s, _ in scalars(whole, tag)], tag
            np.testing.assert_allclose([v for _, v in read(tag)], [v for _, v in scalars(whole, tag)],
                                       rtol=1e-6, err_msg=tag)


@pytest.mark.slow  # 9 s: a run of 8 steps, compiled
def test_tensorboard_steps_are_on_disk_with_each_checkpoint(tmp_path, monkeypatch):
    """What a killed run (SIGKILL, out of host memory) leaves in the event file: every step up to
    its last checkpoint, which a resume from it does not log again. They sat in the file's buffer
    (8 KiB, a dozen steps) until the run's end, and such a resume left a gap in every series. Read
    here from the disk, by another reader, as the run goes: after checkpoint 4, at the last step
    (the final checkpoint's) and after the final evaluation."""
    d = tmp_path / "run"
    on_disk = {}  # when -> the steps of train/loss (eval/eval_loss) the event file holds on disk

    def read(when):
        acc = events(d)
        on_disk[when] = [[e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
                         for tag in ("train/loss", "eval/eval_loss")]

    log, close = RunDir.log, TensorBoard.close
    monkeypatch.setattr(RunDir, "log", lambda self, rec: (log(self, rec), rec["step"] in (5, 7) and read(rec["step"])))
    monkeypatch.setattr(TensorBoard, "close", lambda self, failed=False: (read("close"), close(self, failed)))
    train(config.load(None, [*TINY, *QUICK, "throughput.reps=0", "cms.periods=[1]", "mesh.inter=1", "mesh.intra=8",
                             "checkpoint.every=4", "eval.every=0", "train.steps=8", f"run.dir={d}", "run.quiet=true"]))
    assert on_disk[5] == [[1, 2, 3, 4], []]  # checkpoint 4's steps (the step's record comes before its report)
    assert on_disk[7][0][:4] == [1, 2, 3, 4]
    assert on_disk["close"] == [list(range(1, 9)), [8]]  # the final checkpoint's steps, the final evaluation


@pytest.mark.slow  # 15 s: two runs and their resumes
@pytest.mark.parametrize("cut", ["the final evaluation", "the timing"])
def test_a_final_report_cut_by_ctrl_c_logs_its_evaluation_once_on_resume(tmp_path, monkeypatch, cut):
    """Ctrl-C in the final report (the final checkpoint saved), then --resume, which evaluates the
    checkpoint again: the trackers get the final evaluation once. Cut in the final evaluation,
    the resume never logged it (a resume with nothing left to run took the trackers to hold it);
    cut in the timing after it was logged (summary.json says so at once), not twice."""
    from nljax.run import trainer
    from nljax.run.core import Run
    from nljax.runtime import preemption

    d = tmp_path / "run"
    common = [*TINY, *QUICK, "cms.periods=[1]", "mesh.inter=1", "mesh.intra=8", "checkpoint.every=2", "eval.every=2",
              f"run.dir={d}", "run.quiet=true", "train.steps=4"]
    with monkeypatch.context() as m:
        if cut == "the final evaluation":
            evaluate = Run.evaluate
            m.setattr(Run, "evaluate", lambda self, params, step: evaluate(self, params, step) if step < 4 else
                      (_ for _ in ()).throw(KeyboardInterrupt))
        else:
            m.setattr(trainer, "comm_report", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(preemption.Unreported):
            train(config.load(None, common))
    cut_short = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else None
    if cut == "the timing":  # the final evaluation, logged, is in summary.json at once, with a word on the rest
        assert cut_short["steps"] == 4 and "eval_loss" in cut_short and "throughput" not in cut_short
        assert cut_short["incomplete"].startswith("the rest of the final report comes as it ends")
    else:
        assert cut_short is None
    train(config.load(None, [*common, "checkpoint.resume=latest"]))
    summary = json.loads((d / "summary.json").read_text())
    logged = [(e.step, e.value) for e in events(d).Scalars("eval/eval_loss")]
    assert [s for s, _ in logged] == [2, 4] and logged[1][1] == pytest.approx(summary["eval_loss"], rel=1e-6)
    assert "incomplete" not in summary and "throughput" in summary
    train(config.load(None, [*common, "checkpoint.resume=latest"]))  # again: summary.json says they hold it
    assert [(e.step, e.value) for e in events(d).Scalars("eval/eval_loss")] == logged


def test_a_final_report_cut_without_checkpoints_says_its_summary_stays_so(tmp_path, monkeypatch):
    """checkpoint.every=0, Ctrl-C in the timing: summary.json holds the final evaluation, and its
    word on the rest said it came from the run's --resume, which has no checkpoint to start from."""
    from nljax.run import trainer
    from nljax.runtime import preemption

    d = tmp_path / "run"
    monkeypatch.setattr(trainer, "comm_report", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(preemption.Unreported):
        train(config.load(None, [*TINY, *QUICK, "cms.periods=[1]", "mesh.inter=1", "mesh.intra=8", "train.steps=1",
                                 "checkpoint.every=0", "eval.every=0", f"run.dir={d}", "run.quiet=true"]))
    summary = json.loads((d / "summary.json").read_text())
    assert "eval_loss" in summary and summary["incomplete"] == ("the rest of the final report comes as it ends (a run "
                                                                "cut before: never, with checkpoint.every=0 (no "
                                                                "checkpoint))")


def test_two_runs_opening_their_event_files_in_one_second_keep_both(tmp_path, monkeypatch):
    """tensorboardX names an event file by the second it opens it: a resume that trained nothing,
    within a second of the run before it, truncated that run's file (its events gone; the
    tests of such resumes failed now and then)."""
    import types

    import tensorboardX.event_file_writer as efw

    from nljax.run.trackers import TensorBoard

    monkeypatch.setattr(efw, "time", types.SimpleNamespace(time=lambda: 1.7e9))  # one second for both
    first = TensorBoard(tmp_path)
    first.scalars("eval", {"eval_loss": 2.0}, 4)
    first.close()
    second = TensorBoard(tmp_path, start_step=8)
    second.scalars("eval", {"eval_loss": 1.0}, 8)
    second.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert [(e.step, e.value) for e in events(tmp_path).Scalars("eval/eval_loss")] == [(4, 2.0), (8, 1.0)]


def test_a_resume_that_meets_its_target_at_once_logs_that_evaluation_once(tmp_path):
    """A resume whose checkpoint already meets train.target_eval_loss trains nothing, and its
    evaluation of the checkpoint is the final report's: sent to the trackers where no evaluation
    was at that step (a checkpoint between evaluations), not a second time where one was (during
    training, or the final one of the attempt that ended there)."""
    def run(d, *more):
        train(config.load(None, [*TINY, *QUICK, "cms.periods=[1]", f"run.dir={d}", "run.quiet=true",
                                 "checkpoint.every=2", *more]))
        return [(e.step, e.value) for e in events(d).Scalars("eval/eval_loss")]

    target = ["checkpoint.resume=latest", "train.steps=8", "eval.every=4", "train.target_eval_loss=1000"]
    between = tmp_path / "between"
    assert [s for s, _ in run(between, "train.steps=6", "eval.every=0")] == [6]  # the final evaluation's
    shutil.rmtree(between / "checkpoints" / "6")
    logged = run(between, *target)  # from 4: the events after it purged, no evaluation there until now
    summary = json.loads((between / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["stopped_at_target_eval_loss"] == 1000
    assert logged == [(4, pytest.approx(summary["eval_loss"], rel=1e-6))]
    assert run(between, *target) == logged  # again: the attempt before ended there, logged
    during = tmp_path / "during"
    assert [s for s, _ in run(during, "train.steps=6", "eval.every=4")] == [4, 6]
    shutil.rmtree(during / "checkpoints" / "6")
    assert [s for s, _ in run(during, *target)] == [4]


@pytest.mark.slow
def test_wandb_offline_run_is_continued_by_a_resume(tmp_path, monkeypatch):
    """An offline W&B run writes its files under run.dir/wandb with no network; its id is saved
    in every checkpoint, and a resume continues the run under that id."""
    for key in ("WANDB_MODE", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written outside tmp_path
        monkeypatch.setenv(key, str(tmp_path / key.lower()))
    d = tmp_path / "run"
    common = [*TINY, *QUICK, "cms.periods=[1]", "mesh.inter=1", "mesh.intra=8", "checkpoint.every=2",
              "run.trackers=[wandb]", f"run.dir={d}", "run.quiet=true", "train.sample_every=2", "train.sample_tokens=3"]
    train(config.load(None, [*common, "train.steps=2"]))
    from nljax.checkpoint import storage

    run_id = storage.read_meta(d / "checkpoints" / "2")["trackers"]["wandb"]
    first = list((d / "wandb").glob("offline-run-*"))
    assert [p.name.rsplit("-", 1)[1] for p in first] == [run_id]
    # the run's records (protobuf, read by `wandb sync`): the step's scalars and the sample are there
    logged = (first[0] / f"run-{run_id}.wandb").read_bytes()
    for key in ("train/loss", "train/grad_norm", "train/lr", "train/skipped", "train/fired_l0", "train/sample",
                "eval/eval_loss"):
        assert key.encode() in logged, key
    assert list(first[0].glob("files/media/html/train/sample_*.html"))

    train(config.load(None, [*common, "train.steps=4", "checkpoint.resume=latest"]))
    runs = sorted((d / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and {p.name.rsplit("-", 1)[1] for p in runs} == {run_id}
    assert storage.read_meta(d / "checkpoints" / "4")["trackers"] == {"wandb": run_id}

    # An interruption after 6 steps whose last checkpoint is step 4's: the resumed run redoes the
    # steps logged as 5 and 6 (steps done), which the W&B run holds already, and logs nothing
    # again (it used to, offline).
    train(config.load(None, [*common, "train.steps=6", "checkpoint.resume=latest"]))
    shutil.rmtree(d / "checkpoints" / "6")
    train(config.load(None, [*common, "train.steps=6", "checkpoint.resume=latest"]))
    runs = sorted((d / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
    assert len(runs) == 4 and (d / "checkpoints" / "6").is_dir()
    logged, again = ((p / f"run-{run_id}.wandb").read_bytes() for p in runs[2:])
    for key in (b"train/loss", b"train/sample", b"eval/eval_loss"):
        assert key in logged and key not in again, key


def test_a_bad_tracker_setting_is_one_line(tmp_path, monkeypatch):
    p = cli("nljax.train", "run.trackers=[tensorbord]", check=False, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == ("nljax.train: error: config key 'run.trackers[0]' must be one of "
                                "['tensorboard', 'wandb'], got 'tensorbord'")
    with pytest.raises(ConfigError) as e:
        config.load(None, ["run.tensorboard=false"])
    assert str(e.value) == "run.tensorboard moved to run.trackers (a list: run.trackers=[tensorboard], " \
                           "[tensorboard,wandb] or [])"
    with pytest.raises(ConfigError, match="names a tracker twice"):
        config.load(None, ["run.trackers=[wandb,wandb]"])
    with pytest.raises(ConfigError, match="train.sample_every samples text, and model.name=dit makes images"):
        config.load(None, ["model.name=dit", "cms.periods=[1]", "train.sample_every=10"])
    assert config.load(None, ["run.trackers=wandb"]).run.trackers == ("wandb",)  # one name, no list
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    cfg = config.load(None, ["run.trackers=[tensorboard,wandb]", f"run.dir={tmp_path}"])
    missing = r"^run.trackers has wandb, which is not installed: pip install 'nljax\[wandb\]'"
    with pytest.raises(ConfigError, match=missing):
        check_installed(cfg)  # the trainer's check, before it writes anything
    with pytest.raises(ConfigError, match=missing):
        Trackers.open(cfg, main=True)
    assert Trackers.open(cfg, main=False).trackers == []  # only process 0 opens trackers


FILLS_UP = r"""
import resource, signal, sys
from pathlib import Path
from nljax.run.trackers import TensorBoard
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
tb = TensorBoard(Path(sys.argv[1]))
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.RLIM_INFINITY))
try:
    for step in range(5000):
        tb.scalars("train", {"loss": 1.0, "lr": 0.1, "grad_norm": 2.0}, step)
    tb.close()
except OSError as e:
    print(e.errno, e.filename == str(tb.file), tb.file.name.startswith("events.out.tfevents."))
"""


def test_a_full_disk_under_the_event_file_is_an_error_not_a_hang(tmp_path):
    """The event file cannot grow (a full disk; here a file-size limit): the write fails in the
    run's thread, naming the file (cli's one line). tensorboardX's writer thread died on it, and
    the run then blocked forever on the thread's full queue."""
    import subprocess
    import sys

    from helpers import subprocess_env

    p = subprocess.run([sys.executable, "-c", FILLS_UP, str(tmp_path)], env=subprocess_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.stdout.split() == ["27", "True", "True"], p.stdout + p.stderr


def test_a_non_finite_scalar_is_logged_without_tensorboardxs_warning(tmp_path, caplog):
    """A diverged run logs its NaN loss as it is (metrics.jsonl: null; the run's own line says the
    step skipped); tensorboardX's warning for every non-finite scalar added three lines or more
    at every such step, between the run's."""
    tb = TensorBoard(tmp_path)
    with caplog.at_level(logging.WARNING):
        tb.scalars("train", {"loss": math.nan, "grad_norm": math.inf, "lr": 0.1}, 1)
    tb.close()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    acc = events(tmp_path)
    assert math.isnan(acc.Scalars("train/loss")[0].value) and math.isinf(acc.Scalars("train/grad_norm")[0].value)


WRITES_EVENTS = r"""
import sys
from pathlib import Path
from nljax.run.trackers import TensorBoard
tb = TensorBoard(Path(sys.argv[1]))
tb.scalars("train", {"loss": 1.5}, 0)
tb.close()
print("torch" in sys.modules, "torch" in sys.modules and sys.modules["torch"] is None)  # imported; left refused
"""


def test_tensorboard_does_not_import_torch(tmp_path):
    """tensorboardX's writer imports torch where it is installed (a type for its annotations):
    3 s more at a run's start and 1 to 2 s of torch's teardown at the process's exit, silent after
    the run's last line. The events are written without it, and torch stays importable."""
    import importlib.util
    import subprocess

    from helpers import subprocess_env

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: nothing would import it")
    p = subprocess.run([sys.executable, "-c", WRITES_EVENTS, str(tmp_path)], env=subprocess_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["False", "False"], p.stdout + p.stderr
    assert list(tmp_path.glob("events.out.tfevents.*"))
    from nljax.run.trackers import torch_hidden

    with torch_hidden():  # within, refused (unless this process imported torch already)
        if "torch" not in sys.modules or sys.modules["torch"] is None:
            with pytest.raises(ImportError):
                import torch  # noqa: F401
    assert sys.modules.get("torch", "absent") is not None  # not left refused after it


def test_a_bad_wandb_mode_in_the_environment_is_named_as_the_environments(tmp_path, monkeypatch):
    """WANDB_MODE wins over run.wandb_mode: a bad one is refused as the environment's before the
    run writes anything (a resume's config.yaml was rewritten first), and where W&B refuses the
    mode it starts in, the fix offered is the environment's (run.wandb_mode=offline, which it
    was, would not help)."""
    pytest.importorskip("wandb")
    for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written outside tmp_path
        monkeypatch.setenv(key, str(tmp_path / key.lower()))
    monkeypatch.setenv("WANDB_MODE", "bogus")
    cfg = config.load(None, ["run.trackers=[wandb]", f"run.dir={tmp_path}", "run.wandb_mode=offline"])
    said = ("WANDB_MODE='bogus' is not a W&B mode (Input should be 'online', 'offline', 'shared', 'disabled', "
            "'dryrun' or 'run'); it overrides run.wandb_mode: unset it, or set WANDB_MODE=offline")
    with pytest.raises(ConfigError) as e:
        check_installed(cfg)  # the trainer's check, before it writes anything
    assert str(e.value) == said
    # online with no account (and no key anywhere W&B looks): W&B's own refusal, the fix the environment's
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(ConfigError) as e:
        Trackers.open(cfg, main=True)
    assert str(e.value).startswith("W&B could not start a run (mode online, from the environment variable "
                                   "WANDB_MODE): "), e.value
    assert str(e.value).endswith("; unset WANDB_MODE, or set WANDB_MODE=offline: offline needs neither "
                                 "account nor network"), e.value


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_an_offline_wandb_run_says_where_its_records_are_in_nljaxs_words(tmp_path, monkeypatch, capsys, mode):
    """Offline, W&B's own lines advised `wandb online`, which nljax's explicit mode overrides (the
    run stayed offline): W&B is silent there and the run says where the records are, the command
    that uploads them and the settings that go online. Online, W&B's lines (its run's address)
    are left as they are; --quiet silences both. W&B is a fake module here: its calls recorded."""
    from nljax.run.trackers import Start, WandB

    calls = {}

    def init(**kwargs):
        calls["init"] = kwargs
        (tmp_path / "wandb" / "offline-run-1-abc" / "files").mkdir(parents=True)
        return types.SimpleNamespace(id="abc", step=0, dir=str(tmp_path / "wandb" / "offline-run-1-abc" / "files"))

    fake = types.SimpleNamespace(init=init, Settings=lambda **kwargs: kwargs)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for quiet in (False, True):
        cfg = config.load(None, ["run.trackers=[wandb]", f"run.dir={tmp_path}", f"run.wandb_mode={mode}",
                                 f"run.quiet={str(quiet).lower()}"])
        capsys.readouterr()
        WandB.open(Start(cfg, tmp_path, None, {}))
        said = capsys.readouterr().out
        assert calls["init"]["mode"] == mode
        assert calls["init"]["settings"]["silent"] == (quiet or mode == "offline")
        records = tmp_path / "wandb" / "offline-run-1-abc"
        assert said == ("" if quiet or mode == "online" else
                        f"W&B run abc offline, its records in {records}: wandb sync {records} uploads them "
                        "(run.wandb_mode=online, or WANDB_MODE=online, logs online)\n")
        shutil.rmtree(tmp_path / "wandb")
    # offline by WANDB_MODE, which wins: run.wandb_mode=online, which the line advised too, changes nothing
    monkeypatch.setenv("WANDB_MODE", "offline")
    WandB.open(Start(config.load(None, ["run.trackers=[wandb]", f"run.dir={tmp_path}", f"run.wandb_mode={mode}"]),
                     tmp_path, None, {}))
    assert calls["init"]["mode"] == "offline"
    assert capsys.readouterr().out.endswith(" uploads them (WANDB_MODE=online, which overrides run.wandb_mode, logs "
                                            "online)\n")


def test_a_tracker_that_fails_to_start_leaves_a_resumed_runs_config_as_it_was(tmp_path, monkeypatch, capsys):
    """The trackers open before config.yaml is written: one that failed to start (W&B online
    without an account) stopped a resume after its config.yaml held the failed attempt's
    settings (train.steps, run.trackers), which the next plain --resume then ran with."""
    from nljax.run.trackers import TensorBoard
    from nljax.train import main

    run = tmp_path / "run"
    common = ["model.name=cms_mlp", "model.dim=16", "model.depth=1", "cms.periods=[1]", "train.batch_size=8",
              "train.seq_len=16", "eval.every=0", "eval.batches=1", "throughput.reps=0", "run.plots=false",
              "run.compile_cache=none", f"run.dir={run}"]
    assert main([*common, "train.steps=1", "run.trackers=[]"]) == 0
    before = (run / "config.yaml").read_bytes()

    def fails(start):
        raise ConfigError("the tracker could not start")

    monkeypatch.setattr(TensorBoard, "open", fails)
    capsys.readouterr()
    assert main(["--resume", *common, "train.steps=2", "run.trackers=[tensorboard]"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "nljax.train: error: the tracker could not start"
    assert (run / "config.yaml").read_bytes() == before


@pytest.mark.slow  # an edge case of 10-15 s: the README's suite kept under 15 minutes on 2 cores (.ci/run runs it)
def test_a_resume_that_fails_before_its_first_step_leaves_the_runs_config_as_it_was(tmp_path, monkeypatch, capsys):
    """A resume's settings reach config.yaml once a step has run with them: a resume that failed
    at its first step (out of memory at a larger batch) left them there, and the next plain
    --resume failed the same way. One that runs a step, or has none left to run, writes them."""
    from nljax.run import trainer
    from nljax.train import main

    run = tmp_path / "run"
    common = ["model.name=cms_mlp", "model.dim=16", "model.depth=1", "cms.periods=[1]", "train.batch_size=8",
              "train.seq_len=16", "eval.every=0", "eval.batches=1", "throughput.reps=0", "run.plots=false",
              "run.compile_cache=none", "run.trackers=[]", f"run.dir={run}"]
    assert main([*common, "train.steps=1"]) == 0
    before = (run / "config.yaml").read_bytes()
    steps = trainer.training_steps

    def fails(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        yield  # a generator, as training_steps is

    monkeypatch.setattr(trainer, "training_steps", fails)
    capsys.readouterr()
    assert main(["--resume", *common, "train.steps=2", "eval.batches=2"]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("nljax.train: error: out of memory")
    assert (run / "config.yaml").read_bytes() == before
    monkeypatch.setattr(trainer, "training_steps", steps)
    saved = lambda: yaml.safe_load((run / "config.yaml").read_text())
    assert main(["--resume", *common, "train.steps=2", "eval.batches=2"]) == 0
    assert (saved()["train"]["steps"], saved()["eval"]["batches"]) == (2, 2)
    assert main(["--resume", *common, "train.steps=2", "eval.batches=3"]) == 0  # nothing left to train
    assert saved()["eval"]["batches"] == 3

    def one_then_fails(*args, **kwargs):  # a step ran with the new settings: they are the run's
        yield next(steps(*args, **kwargs))
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(trainer, "training_steps", one_then_fails)
    assert main(["--resume", *common, "train.steps=4", "eval.batches=4"]) == 1
    assert (saved()["train"]["steps"], saved()["eval"]["batches"]) == (4, 4)


class _FakeWandbRun:
    """What `WandB` reads and calls of a W&B run."""

    def __init__(self, step=0):
        self.id, self.step, self.logged, self.exit_code = "abc123", step, [], None

    def log(self, values, step):
        self.logged.append(step)

    def finish(self, exit_code):
        self.exit_code = exit_code


def test_wandb_skips_the_steps_logged_before_and_records_the_last(tmp_path):
    """A resumed W&B run logs from the step after the last one it logged (kept in a file at
    close), and says a failed run failed; a run that logged nothing writes no step."""
    from nljax.run.trackers import WandB

    logged = tmp_path / "nljax-last-step-abc123"
    w = WandB(_FakeWandbRun(), logged)
    w.close()
    assert not logged.exists() and w.run.exit_code == 0
    w = WandB(_FakeWandbRun(), logged)
    for step in range(3):
        w.scalars("train", {"loss": 1.0, "flag": True}, step)
    w.close(failed=True)
    assert w.run.logged == [0, 1, 2] and w.run.exit_code == 1 and logged.read_text() == "2"
    w = WandB(_FakeWandbRun(), logged)  # a resume from step 1's checkpoint: steps 1, 2 are logged already
    for step in range(1, 5):
        w.scalars("train", {"loss": 1.0}, step)
    w.close()
    assert w.run.logged == [3, 4] and logged.read_text() == "4"
    logged.unlink()
    w = WandB(_FakeWandbRun(), logged)  # step 0 alone is a step logged too
    w.scalars("train", {"loss": 1.0}, 0)
    w.close()
    assert logged.read_text() == "0" and WandB(_FakeWandbRun(), logged).first_step == 1


def test_only_numbers_are_logged_and_only_run_ids_are_kept():
    from nljax.run.trackers import numbers

    assert numbers({"loss": 1.5, "step": 3, "skipped": True, "pattern": "L0"}) == {"loss": 1.5, "step": 3}
    tb = types.SimpleNamespace(name="tensorboard", run_id=None)
    wb = types.SimpleNamespace(name="wandb", run_id="abc123")
    assert Trackers([tb, wb]).ids == {"wandb": "abc123"}


def test_tensorboard_events_reach_the_file_every_flush_s_without_a_flush(tmp_path, monkeypatch):
    """A TensorBoard watching a run sees its scalars within FLUSH_S, before a checkpoint flushes."""
    monkeypatch.setattr(TensorBoard, "FLUSH_S", 0.0)
    tb = TensorBoard(tmp_path)
    tb.scalars("train", {"loss": 2.5}, 1)
    time.sleep(0.01)
    tb.scalars("train", {"loss": 2.0}, 2)
    try:
        assert [e.step for e in events(tb.file).Scalars("train/loss")] == [1, 2]
    finally:
        tb.close()
