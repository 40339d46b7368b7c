"""nljax's lm-evaluation-harness model (nljax/lm_eval.py, nljax/run/harness_model.py,
nljax/run/scoring.py) and `eval.harness_tasks` (nljax/run/harness.py), against nljax's own
scoring of the same strings.

One tiny run is trained by `python -m nljax.train` with two local lm-eval tasks in
eval.harness_tasks (a multiple choice read from a JSON file and a rolling loglikelihood one; no
download: the task YAMLs read `json` data files written here, with the Hugging Face libraries
offline). lm-eval then scores it through its own Python API on 8 devices and through
`python -m nljax.lm_eval` on 1, and both must give what `nljax.load(...).logits` gives for the
same strings, read window by window with the memory carried by hand.
"""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
from helpers import QUICK, ROOT, TINY, TINY_NL, bpe_corpus, cli, lock, saved_run, subprocess_env

pytest.importorskip("lm_eval")  # the `lm-eval` extra (in `dev`)

import nljax  # noqa: E402
from nljax.errors import ConfigError  # noqa: E402

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing here may reach the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}

SEQ = 16  # train.seq_len: the long contexts below cross two and three windows
NL = [*TINY, *TINY_NL, f"train.seq_len={SEQ}", "cms.periods=[1]"]

# Contexts of 3 to 45 bytes: some within one window, some crossing windows
MC = [
    {"question": "def f(x):\n    return", "choices": [" x", " zebra"], "label": 0},
    {"question": "import os\nimport", "choices": [" sys", " 12345", " re"], "label": 0},
    {"question": "for", "choices": [" i in range(10):", " )))"], "label": 0},
    {"question": "class Stream:\n    def __init__(self, data):\n        self.", "choices": ["data = data", "!!"],
     "label": 0},
]
ROLL = [
    {"text": "def add(a, b):\n    return a + b\n"},
    {"text": "class Foo:\n    def __init__(self):\n        self.x = 1\n\n    def bar(self):\n        return self.x\n"},
    {"text": "x = 1"},
]


def write_tasks(root):
    """Two lm-eval tasks reading local JSON lines: tiny_mc (multiple choice) and tiny_roll
    (rolling loglikelihood: word and byte perplexity, bits per byte)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, rows in (("mc", MC), ("roll", ROLL)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: label\n"
        "doc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\nmetadata:\n  version: 1.0\n")
    (root / "tiny_roll.yaml").write_text(
        f"task: tiny_roll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'roll.jsonl'}\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
        "metadata:\n  version: 1.0\n")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run directory, task directory): 2 steps on 2 devices, the harness tasks evaluated after
    the first step and at the end."""
    root = tmp_path_factory.mktemp("lm_eval")
    tasks = write_tasks(root / "tasks")
    run_dir = root / "run"
    cli("nljax.train", "--cpu-devices", "2", *NL, *QUICK, "run.trackers=[tensorboard]", "train.steps=2",
        "eval.every=1", "eval.batches=1", "eval.stream_steps=0", "eval.harness_tasks=[tiny_mc,tiny_roll]",
        f"eval.harness_include={tasks}", f"run.dir={run_dir}", env=OFFLINE)
    return run_dir, tasks


@pytest.fixture(scope="module")
def lm(trained):
    return nljax.load(trained[0])


def own_logprobs(lm, ids: list[int], ends_reset: bool = True) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, read as the harness promises, by hand with
    `TrainedModel.logits`: windows of seq_len inputs from the first token, the memory fresh at the
    start and carried, reset after a window that holds the document end (the stream's first
    token aside; `ends_reset` False: never)."""
    inputs, targets = ids[:-1], np.asarray(ids[1:])
    memory, out, reset = None, [], True
    for start in range(0, len(inputs), lm.seq_len):
        window = inputs[start : start + lm.seq_len]
        logits, memory = lm.logits([window], memory, reset=[reset])
        out.append(logits[0].astype(np.float64))
        reset = ends_reset and lm.end_id in window[1 if start == 0 else 0 :]
    logits = np.concatenate(out)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return logp[np.arange(len(targets)), targets]


DELIMITER = " "  # lm-eval's target_delimiter: a multiple-choice continuation is " " + the choice


def own_mc(lm, doc) -> list[float]:
    """Each choice's loglikelihood: context + continuation tokenized whole, the continuation's
    tokens those after the context's (lm-eval's split for causal models)."""
    ctx = lm.encode(doc["question"])
    out = []
    for choice in doc["choices"]:
        whole = lm.encode(doc["question"] + DELIMITER + choice)
        out.append(float(own_logprobs(lm, whole)[len(ctx) - 1 :].sum()))
    return out


def own_rolling(lm, text) -> float:
    return float(own_logprobs(lm, [lm.end_id, *lm.encode(text)]).sum())


def expected(lm) -> dict:
    """What the harness must report, from nljax's own scores."""
    mc = [own_mc(lm, d) for d in MC]
    ll = [own_rolling(lm, d["text"]) for d in ROLL]
    words = sum(len(re.split(r"\s+", d["text"])) for d in ROLL)  # lm-eval's word count
    nbytes = sum(len(d["text"].encode()) for d in ROLL)
    return {"mc": mc, "acc": float(np.mean([np.argmax(s) == d["label"] for s, d in zip(mc, MC, strict=True)])),
            "rolling": ll,
            "word_perplexity": math.exp(-sum(ll) / words), "byte_perplexity": math.exp(-sum(ll) / nbytes),
            "bits_per_byte": -sum(ll) / nbytes / math.log(2)}


def check(results: dict, samples: dict, want: dict) -> None:
    got_mc = [[float(r[0][0]) for r in s["resps"]] for s in sorted(samples["tiny_mc"], key=lambda s: s["doc_id"])]
    np.testing.assert_allclose(np.concatenate(got_mc), np.concatenate(want["mc"]), rtol=1e-5, atol=1e-4)
    got_roll = [float(s["resps"][0][0]) for s in sorted(samples["tiny_roll"], key=lambda s: s["doc_id"])]
    np.testing.assert_allclose(got_roll, want["rolling"], rtol=1e-5, atol=1e-4)
    r = results["tiny_mc"], results["tiny_roll"]
    assert r[0]["acc,none"] == pytest.approx(want["acc"])
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert r[1][f"{metric},none"] == pytest.approx(want[metric], rel=1e-5), metric


def harness_run(model, tasks) -> dict:
    """lm-eval's Python API on the two local tasks, nothing downloaded."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, tasks=["tiny_mc", "tiny_roll"], bootstrap_iters=0,
                           task_manager=TaskManager(include_path=str(tasks), include_defaults=False))


def test_the_harness_scores_as_nljax_on_8_and_1_devices(trained, lm):
    """lm-eval's Python API with the model on 8 devices (batches of 3 requests: rows padded to 8)
    and on 1 gives nljax's own loglikelihoods, accuracy and perplexities."""
    import jax

    from nljax.lm_eval import FromRun
    from nljax.parallel.mesh import make_mesh
    from nljax.run.harness_model import NLJaxLM, Reading
    from nljax.run.scoring import StreamReader

    run_dir, tasks = trained
    want = expected(lm)
    # as lm-eval's command line makes it: batch_size= of --model_args wins over --batch_size
    model = FromRun.create_from_arg_string(f"run_dir={run_dir},checkpoint=2,batch_size=3",
                                           {"batch_size": 1, "max_batch_size": None, "device": "cpu"})
    assert model.reader.rows == 8 and model.reader.split.mesh.size == 8 and "(step 2)" in model.reading.name
    out = harness_run(model, tasks)
    asked = [a for s in sorted(out["samples"]["tiny_mc"], key=lambda s: s["doc_id"]) for a in s["arguments"]]
    assert asked == [(d["question"], DELIMITER + c) for d in MC for c in d["choices"]]  # the strings scored here
    check(out["results"], out["samples"], want)
    one = make_mesh(1, 1, jax.devices()[:1])
    single = NLJaxLM(Reading(StreamReader(lm.model, lm.params, one, lm.seq_len, lm.end_id, 2,
                                                  vocab=lm.config.model.vocab_size), lm.tokenizer, "one"))
    out = harness_run(single, tasks)
    check(out["results"], out["samples"], want)


@pytest.mark.slow  # a fresh process with lm-eval and JAX: about a minute on 2 cores
def test_the_command_line_scores_as_nljax_on_1_device(trained, lm, tmp_path):
    """`python -m nljax.lm_eval --cpu-devices 1 --model nljax ...`: lm-eval's own command line
    writes nljax's own scores (its results and samples under --output_path)."""
    run_dir, tasks = trained
    cli("nljax.lm_eval", "--cpu-devices", "1", "--model", "nljax", "--model_args", f"run_dir={run_dir},batch_size=2",
        "--tasks", "tiny_mc,tiny_roll", "--include_path", str(tasks), "--output_path", str(tmp_path / "out"),
        "--log_samples", env=OFFLINE)
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    samples = {t: [json.loads(line) for line in next((tmp_path / "out").rglob(f"samples_{t}_*.jsonl")).open()]
               for t in ("tiny_mc", "tiny_roll")}
    check(results, samples, expected(lm))


def test_a_long_context_is_read_in_windows_with_the_memory(trained, lm):
    """A context three windows long scores as reading it window by window with the memory carried
    by hand, and the memory matters (scored from the last window alone it differs); the answer
    does not depend on the other requests of the batch."""
    from lm_eval.api.instance import Instance

    from nljax.lm_eval import FromRun

    model = FromRun(run_dir=str(trained[0]), batch_size=2)
    ctx = "import os\nimport sys\n\ndef main(argv):\n    for arg in argv:\n        print("
    assert len(lm.encode(ctx)) > 2 * SEQ
    reqs = [Instance("loglikelihood", {}, (ctx, "arg)"), 0), Instance("loglikelihood", {}, ("x", " = 1"), 0),
            Instance("loglikelihood", {}, (ctx[-10:], "arg)"), 0)]
    (long, _), (short, _), (cut, _) = model.loglikelihood(reqs)
    whole = lm.encode(ctx + "arg)")
    assert long == pytest.approx(float(own_logprobs(lm, whole)[-4:].sum()), rel=1e-5)
    assert short == pytest.approx(float(own_logprobs(lm, lm.encode("x = 1"))[-4:].sum()), rel=1e-5)
    assert cut == pytest.approx(float(own_logprobs(lm, lm.encode(ctx[-10:] + "arg)"))[-4:].sum()), rel=1e-5)
    assert abs(long - cut) > 1e-4, "the earlier windows change nothing: the test proves nothing"
    alone = model.loglikelihood([reqs[0]])[0][0]
    assert alone == pytest.approx(long, rel=1e-6)
    # a document's end inside a rolling text resets the memory after its window, as in training
    text = ctx[:20] + "\0" + ctx[20:]
    (rolled,) = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = [lm.end_id, *lm.encode(text)]
    assert rolled == pytest.approx(float(own_logprobs(lm, ids).sum()), rel=1e-5)
    assert abs(rolled - float(own_logprobs(lm, ids, ends_reset=False).sum())) > 1e-4


def test_generate_until_is_nljax_generate_greedy(trained, lm):
    """generate_until, batched over prompts of different lengths (one crossing windows), gives
    `TrainedModel.generate` with temperature 0 and the request's `until` as its stop strings
    (ended at the document-end token too: both ways)."""
    from lm_eval.api.instance import Instance

    from nljax.lm_eval import FromRun

    model = FromRun(run_dir=str(trained[0]), batch_size=2)
    prompts = ["def ", "import os\nimport sys\nclass A:\n    x = ", "for i in "]
    until = ["\n\n"]
    reqs = [Instance("generate_until", {}, (p, {"until": until, "max_gen_toks": 24}), 0) for p in prompts]
    got = model.generate_until(reqs)
    for prompt, text in zip(prompts, got, strict=True):
        assert text == lm.generate(prompt, max_new_tokens=24, temperature=0, stop=until)
        full = lm.generate(prompt, max_new_tokens=24, temperature=0, stop_at_eos=False)
        for stop in [*until, "\0"]:  # and the document end, lm-eval's models' default stop
            full = full.split(stop)[0]
        assert text == full


def test_eval_harness_tasks_logs_beside_eval_bpb(trained, lm):
    """The training run logged the harness metrics in metrics.jsonl and TensorBoard at its
    evaluations and in summary.json at the end; the final ones are what lm-eval gives on the final
    checkpoint."""
    run_dir = trained[0]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    evaluated = [r for r in records if "eval_bpb" in r]
    assert evaluated and all("harness_tiny_mc_acc" in r and "harness_tiny_roll_word_perplexity" in r
                             for r in evaluated)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/harness_tiny_mc_acc")] == [1, 2]  # after step 0, and at the end
    summary = json.loads((run_dir / "summary.json").read_text())
    want = expected(lm)  # lm: the final checkpoint (step 2), the parameters of the final evaluation
    assert lm.step == 2
    assert summary["harness_tiny_mc_acc"] == pytest.approx(want["acc"])
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert summary[f"harness_tiny_roll_{metric}"] == pytest.approx(want[metric], rel=1e-5), metric
    assert summary["harness_time_s"] > 0


@pytest.mark.slow  # a fresh process: about 40 s on 2 cores (the unknown task searches lm-eval's own index)
def test_an_unknown_task_stops_the_trainer_before_it_writes(trained, tmp_path):
    run_dir = tmp_path / "run"
    p = cli("nljax.train", *NL, *QUICK, "train.steps=1", "eval.harness_tasks=[tiny_mc,no_such_task]",
            f"eval.harness_include={trained[1]}", f"run.dir={run_dir}", check=False, env=OFFLINE)
    assert p.returncode != 0 and not run_dir.exists()
    assert "unknown lm-eval task(s) no_such_task" in p.stderr.strip().splitlines()[-1]


@pytest.fixture
def local_tasks_only(monkeypatch):
    """lm-eval's TaskManager without its own thousands of tasks (indexing them takes seconds)."""
    import lm_eval.tasks

    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: real(**{**kw, "include_defaults": False}))


def test_bad_harness_settings_are_one_line(trained, tmp_path, monkeypatch, local_tasks_only):
    """A task lm-eval does not know, a missing task directory, a task whose data cannot be read,
    lm-eval missing, bad --model_args: each one line."""
    from helpers import make

    import nljax.run
    from nljax.lm_eval import FromRun
    from nljax.run import harness

    tasks = trained[1]
    with pytest.raises(ConfigError, match=r"^eval.harness_tasks: unknown lm-eval task\(s\) no_such_task \("):
        harness.task_manager(["tiny_mc", "no_such_task"], str(tasks))
    with pytest.raises(ConfigError, match="is not a directory"):
        harness.task_manager(["tiny_mc"], str(tmp_path / "nowhere"))
    setup = make([*NL, "eval.harness_tasks=[tiny_mc]", f"eval.harness_include={tasks}"])
    assert harness.attach(setup.run).harness is not None
    broken = tmp_path / "broken"  # a task whose data file is gone
    broken.mkdir()
    (broken / "tiny_mc.yaml").write_text((tasks / "tiny_mc.yaml").read_text().replace("mc.jsonl", "gone.jsonl"))
    cfg = setup.run.cfg
    elsewhere = dataclasses.replace(setup.run, cfg=dataclasses.replace(
        cfg, eval=dataclasses.replace(cfg.eval, harness_include=str(broken))))
    with pytest.raises(ConfigError, match=r"^eval.harness_tasks: cannot load tiny_mc: ") as e:
        harness.attach(elsewhere)
    assert "\n" not in str(e.value)
    for name in [m for m in sys.modules if m.split(".")[0] == "lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import lm_eval...` raises ImportError
    monkeypatch.delitem(sys.modules, "nljax.run.harness_model")
    monkeypatch.delattr(nljax.run, "harness_model")
    with pytest.raises(ConfigError, match=r"needs lm-eval .*pip install 'nljax\[lm-eval\]'"):
        harness.attach(setup.run)
    monkeypatch.undo()
    for kwargs, words in ((dict(run_dir=str(tmp_path)), "is neither an export directory"),
                          (dict(run_dir=str(trained[0]), batch_size=0), "batch_size must be >= 1"),
                          (dict(run_dir=str(trained[0]), checkpoint=7), "has no checkpoint at step 7 (its "
                                                                      "checkpoints are at step"),
                          (dict(run_dir=str(trained[0]), temperature=2), "unknown key(s) temperature"), ({}, "needs")):
        with pytest.raises(ConfigError) as e:
            FromRun(**kwargs)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_training_without_harness_tasks_never_imports_lm_eval():
    code = "import sys, nljax.train, nljax.run.trainer; assert 'lm_eval' not in sys.modules, 'lm_eval imported'"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=subprocess_env())
    assert p.returncode == 0, p.stderr


def test_register_enters_the_model_in_lm_evals_registry():
    """`register()` (what `python -m nljax.lm_eval` calls first) makes `--model nljax` lm-eval's
    own name for the model, beside lm-eval's models, so `simple_evaluate(model="nljax")` finds it."""
    from lm_eval.api.registry import get_model

    from nljax.lm_eval import FromRun, register

    register()
    register()  # twice: no error (a second registration under the name would raise)
    assert get_model("nljax") is FromRun and get_model("dummy").__name__ == "DummyLM"


def test_lm_evals_own_refusal_from_python_is_a_code_and_leaves_sys_argv(capsys):
    """`nljax.lm_eval.main([...])` from a notebook or a script: an option lm-eval's own parser
    refuses raised its SystemExit (a notebook's cell: "SystemExit: 2"), where nljax's refusals
    are codes; and the process's sys.argv stayed lm-eval's command line."""
    from nljax import lm_eval

    argv = list(sys.argv)
    assert lm_eval.main(["--bogus"]) == 2
    assert sys.argv == argv
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_the_command_without_lm_eval_reads_its_help_and_is_one_line(monkeypatch, capsys):
    """lm-eval missing (its import fails, as in an install without the extra): `--help` prints
    the command's own options and how to install lm-eval (exit 0); a run is one line naming both
    install forms, refused as the environment is (exit 2). Run as `python -m` runs it."""
    import runpy

    for name in [m for m in sys.modules if m.split(".")[0] == "lm_eval"] + ["lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import lm_eval...` raises ImportError
    monkeypatch.setitem(sys.modules, "nljax.run.harness_model", None)
    monkeypatch.delitem(sys.modules, "nljax.lm_eval", raising=False)  # run as a fresh __main__, as `python -m` does
    install = "pip install 'nljax[lm-eval]' (in a checkout of nljax: pip install -e '.[lm-eval]')"
    for argv, code in ((["--help"], 0), (["--model", "nljax", "--tasks", "x"], 2)):
        monkeypatch.setattr(sys, "argv", ["nljax.lm_eval", *argv])
        with pytest.raises(SystemExit) as e:
            runpy.run_module("nljax.lm_eval", run_name="__main__")
        assert e.value.code == code
        out, err = capsys.readouterr()
        if code == 0:
            text = " ".join(out.split())  # argparse wraps the lines
            assert "--cpu-devices N" in text and "lm-eval is not installed" in text and install in text, text
            assert "Once it is, every other argument is lm-eval's" in text and err == ""
        else:
            assert err.strip().splitlines() == [err.strip()] and err.startswith("nljax.lm_eval: error: lm-eval is "
                                                                                "not installed ("), err
            assert err.strip().endswith(install)
    # the guide's install line is one of the two forms the message names
    assert "pip install -e '.[lm-eval]'" in (ROOT / "docs" / "guides" / "evaluation.md").read_text()


def stand_in_run(d, *overrides: str, checkpoint: bool = True):
    """A run directory to the checks of --model_args before lm-eval's start-up: its config.yaml
    (the defaults with `overrides`) and a step directory as nljax commits one (its files empty:
    never restored here)."""
    import yaml

    from nljax import config
    from nljax.checkpoint.storage import META, ORBAX_META

    (d / "config.yaml").write_text(yaml.safe_dump(config.to_dict(config.load(None, overrides)), sort_keys=False))
    if not checkpoint:
        return
    (d / "checkpoints" / "1" / META).mkdir(parents=True)
    (d / "checkpoints" / "1" / META / "metadata").write_text("")
    (d / "checkpoints" / "1" / ORBAX_META).write_text("")


def test_an_unknown_task_is_one_line_and_other_errors_pass(tmp_path, monkeypatch, capsys, local_tasks_only):
    """`--tasks nosuchtask`: lm-eval's ValueError("Tasks not found: ...") becomes one line and
    exit 2 (a 27-line traceback and exit 1 before), raised by lm-eval itself as it matches the
    tasks (the model is not built: the tasks are matched first). Any other ValueError, or one
    of that wording that lm-eval did not raise, is not the command's to describe: it passes."""
    from lm_eval import __main__ as lm_eval_main

    from nljax import lm_eval

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command sets lm-eval's argv
    tasks = write_tasks(tmp_path / "tasks")
    stand_in_run(tmp_path)
    assert lm_eval.main(["--model", "nljax", "--model_args", f"run_dir={tmp_path}", "--tasks", "tiny_mc,nosuchtask",
                         "--include_path", str(tasks)]) == 2
    # lm-eval's start-up is said before it (seconds), the refusal after it one line
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [lm_eval.STARTING, "nljax.lm_eval: error: unknown task(s): nosuchtask (`lm_eval ls tasks` lists "
                                     "lm-eval's; a task of your own: --include_path DIR)"], err

    for message in ("Tasks not found: x", "something else"):
        def fails(message=message):
            raise ValueError(message)

        monkeypatch.setattr(lm_eval_main, "cli_evaluate", fails)
        with pytest.raises(ValueError, match=message):
            lm_eval.main(["--model", "nljax", "--model_args", f"run_dir={tmp_path}", "--tasks", "x"])


def test_a_task_file_lm_eval_skips_is_named_and_home_is_expanded(tmp_path, monkeypatch, capsys, local_tasks_only):
    """A task YAML lm-eval cannot load is skipped by its index in silence (a debug log), and its
    task was "unknown" with no word of why: the refusal names the file and its error. A
    `--include_path=~/...` (the shell leaves `~` after `=` as typed) reaches lm-eval expanded:
    its tasks were unknown while nljax's own check had found the directory."""
    from nljax import lm_eval
    from nljax.run import harness

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HOME", str(tmp_path))
    tasks = write_tasks(tmp_path / "tasks")
    broken = tasks / "tiny_broken.yaml"
    broken.write_text("task: tiny_broken\ndoc_to_text: [unclosed\n")
    stand_in_run(tmp_path)
    argv = ["--model", "nljax", "--model_args", f"run_dir={tmp_path}", "--include_path=~/tasks"]
    assert lm_eval.main([*argv, "--tasks", "tiny_broken"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("nljax.lm_eval: error: unknown task(s): tiny_broken (`lm_eval ls tasks` lists lm-eval's; a "
                          f"task of your own: --include_path DIR); {broken} does not load: "), err
    hint = err.split("DIR)", 1)[1]
    assert harness.unloadable(str(tasks)) == hint
    with pytest.raises(ConfigError) as e:  # the trainer's eval.harness_tasks refusal says it too
        harness.task_manager(["tiny_broken"], str(tasks))
    assert str(e.value).endswith(f"a task of your own: eval.harness_include=DIR){hint}"), str(e.value)
    broken.unlink()
    assert harness.unloadable(str(tasks)) == "" and harness.unloadable("") == ""
    matched = []  # the tasks lm-eval matched under the expanded path, then its start stopped there
    from lm_eval.tasks.manager import TaskManager  # the class (local_tasks_only replaced lm_eval.tasks')

    class Matched(Exception):
        pass

    def matching(self, names, real=TaskManager.match_tasks):
        matched.extend(real(self, names))
        raise Matched

    monkeypatch.setattr(TaskManager, "match_tasks", matching)
    with pytest.raises(Matched):
        lm_eval._evaluate(None, [*argv, "--tasks", "tiny_mc"])
    assert matched == ["tiny_mc"]
    assert lm_eval.expand_home(["-o", "~/o", "--output_path=~/p", "--tasks", "~x"]) == [
        "-o", f"{tmp_path}/o", f"--output_path={tmp_path}/p", "--tasks", "~x"]


@pytest.fixture
def never_started(monkeypatch):
    """lm-eval's start replaced by an AssertionError("lm-eval started"): what the early checks let
    through raises it, what they refuse never reaches it."""
    from lm_eval import __main__ as lm_eval_main

    def started():
        raise AssertionError("lm-eval started")

    monkeypatch.setattr(lm_eval_main, "cli_evaluate", started)
    monkeypatch.setattr(sys, "argv", list(sys.argv))


def test_bad_model_args_are_one_line_before_lm_evals_start_up(tmp_path, never_started, capsys):
    """nljax's own --model_args (the keys, run_dir=, checkpoint=, batch_size=) are checked before lm-eval's
    start-up (its task index, the tasks' data: 20 s and more before), with FromRun's lines."""
    from nljax import lm_eval

    nope = tmp_path / "nope"
    for args, line in (
            ([f"run_dir={nope}"], f"{nope} is neither an export directory (python -m nljax.export) nor a run directory "
                                  "(python -m nljax.train's run.dir, with its config.yaml)"),
            ([f"run_dir={tmp_path},batchsize=4"], "--model_args: unknown key(s) batchsize for --model nljax (it takes "
                                                  "run_dir=, checkpoint=, params= and batch_size=)"),
            ([f"run_dir={tmp_path}", "batchsize=4"], "--model_args: unknown key(s) batchsize for --model nljax (it "
                                                     "takes run_dir=, checkpoint=, params= and batch_size=)"),
            ([], "--model nljax needs --model_args run_dir=DIR (a run directory nljax.train wrote, or an export "
                 "directory)")):
        assert lm_eval.main(["--model", "nljax", *(["--model_args", *args] if args else []), "--tasks", "x"]) == 2
        assert capsys.readouterr().err.strip() == f"nljax.lm_eval: error: {line}"
    (tmp_path / "config.yaml").write_text("")
    assert lm_eval.main(["--model", "nljax", "--model_args", f'{{"run_dir": "{tmp_path}", "batch_size": 0}}',
                         "--tasks", "x"]) == 2
    assert capsys.readouterr().err.strip() == "nljax.lm_eval: error: batch_size must be >= 1, got 0"
    (tmp_path / "config.yaml").write_text("train:\n  steps: 3\n")  # a run that saved no checkpoint
    assert lm_eval.main(["--model", "nljax", "--model_args", f"run_dir={tmp_path},checkpoint=3", "--tasks", "x"]) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.lm_eval: error: checkpoint=3: {tmp_path} has no checkpoint at "
                                               f"step 3 ({tmp_path / 'checkpoints'} holds none)")
    # empty: a fresh start's checkpoint.resume, an AssertionError's traceback once lm-eval had started
    assert lm_eval.main(["--model", "nljax", "--model_args", f"run_dir={tmp_path},checkpoint=", "--tasks", "x"]) == 2
    assert capsys.readouterr().err.strip() == ("nljax.lm_eval: error: checkpoint= is empty: give latest (the "
                                               "default), a step number or a step directory")
    # the moving average of a run that keeps none (optim.ema_decay=0)
    assert lm_eval.main(["--model", "nljax", "--model_args", f"run_dir={tmp_path},params=average", "--tasks", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "nljax.lm_eval: error: params=average: the run keeps no moving average of its parameters (optim.ema_decay=0 "
        f"in {tmp_path / 'config.yaml'}): leave params= out, or give params=trained")
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    with pytest.raises(AssertionError, match="lm-eval started"):  # good ones, and another model's: lm-eval's
        lm_eval.main(["--model", "nljax", "--model_args", f"run_dir={tmp_path},checkpoint=3", "--tasks", "x"])
    with pytest.raises(AssertionError, match="lm-eval started"):
        lm_eval.main(["--model", "hf", "--model_args", "pretrained=x,batchsize=4", "--tasks", "x"])


def test_lm_evals_own_options_and_runs_it_cannot_read_are_one_line_before_its_start_up(tmp_path, never_started,
                                                                                      capsys):
    """What lm-eval failed on with a traceback (exit 1) after its start-up, or not at all, is one
    line and exit 2 before it: --tasks missing, empty or a name with spaces around it ("a, b" as
    one word), --limit 0 or below, an --output_path it cannot make (a warning after the whole
    evaluation, exit 0, the results not written), --batch_size 0, an --include_path that is no
    directory (its tasks "unknown": "give --include_path"), a MeanFlow run or its export (refused
    after lm-eval's start-up) and a run with no checkpoint yet."""
    from nljax import lm_eval

    run = tmp_path / "run"
    run.mkdir()
    stand_in_run(run)
    (tmp_path / "notes.md").write_text("mine")
    (tmp_path / "earlier.json").write_text("{}")
    notes = tmp_path / "notes.md"
    base = ["--model", "nljax", "--model_args", f"run_dir={run}"]
    spaces = "(names are separated by commas, or by spaces as separate words: --tasks a,b or --tasks a b)"
    fraction = "give a number of examples per task (>= 1) or a fraction of them (between 0 and 1)"
    for args, line in (
            ([], "--tasks is missing: name lm-eval's tasks (--tasks lambada_openai,hellaswag; `lm_eval ls tasks` lists "
                 "them)"),
            (["--tasks", ""], f"--tasks '' holds an empty task name {spaces}"),
            (["--tasks", ",tiny_mc"], f"--tasks ',tiny_mc' holds an empty task name {spaces}"),
            (["--tasks", "a,,b"], f"--tasks 'a,,b' holds an empty task name {spaces}"),
            (["--tasks", "a", "b,"], f"--tasks 'a b,' holds an empty task name {spaces}"),
            (["--tasks", "a, b"], "--tasks: task name ' b' has spaces around it (write --tasks a,b or --tasks a b)"),
            (["--tasks", "a", "--limit", "0"], f"--limit 0: {fraction}"),
            (["--tasks", "a", "-L", "-1"], f"--limit -1: {fraction}"),
            (["--tasks", "a", "--output_path", str(notes)], f"--output_path {notes} is a file, not a directory"),
            (["--tasks", "a", "-o", f"{notes}/r.json"], f"--output_path {notes}/r.json: {notes} is a file, not a "
                                                         "directory"),
            (["--tasks", "a", "--output_path", f"{notes}/out/"], f"--output_path {notes}/out/: {notes} is a file, not "
                                                                  "a directory"),
            (["--tasks", "a", "--batch_size", "0"], "batch_size must be >= 1, got 0"),
            (["--tasks", "a", "--include_path", str(notes)], f"--include_path {notes} is not a directory (of lm-eval "
                                                             "task YAML files)"),
            (["--tasks", "a", "--include_path", str(tmp_path / "nope")], f"--include_path {tmp_path / 'nope'} is not "
                                                                        "a directory (of lm-eval task YAML files)")):
        assert lm_eval.main([*base, *args]) == 2, args
        assert capsys.readouterr().err.strip() == f"nljax.lm_eval: error: {line}"
    for args in (["-t", "a", "b", "--include_path", str(tmp_path)],
                 ["--tasks", "a,b", "--limit", "0.5", "-o", str(tmp_path / "new" / "r.json")],
                 ["--tasks", "a", "--limit", "2", "--output_path", str(tmp_path)], ["--config", "mine.yaml"],
                 ["--tasks", "a", "-o", str(tmp_path / "earlier.json")],  # kept: r_<time>.json written beside it
                 ["--tasks", "a", "--limit", "abc"]):  # lm-eval's parser refuses that, in its own usage line
        with pytest.raises(AssertionError, match="lm-eval started"):
            lm_eval.main([*base, *args])
    with pytest.raises(AssertionError, match="lm-eval started"):  # another model's: lm-eval's options checked alike
        lm_eval.main(["--model", "hf", "--tasks", "a"])
    assert lm_eval.main(["--model", "hf", "--tasks", "a,"]) == 2
    assert lm_eval.main(["run", "--model", "hf"]) == 2  # the subcommand spelt out
    capsys.readouterr()
    for args in (["ls", "tasks"], ["validate", "--tasks", "a"], [], ["run"]):  # no evaluation: lm-eval's own (help)
        with pytest.raises(AssertionError, match="lm-eval started"):
            lm_eval.main(args)
    capsys.readouterr()

    image = tmp_path / "image"
    image.mkdir()
    stand_in_run(image, "model.name=dit", "images.source=moons", "cms.periods=[1]")
    empty = tmp_path / "empty"
    empty.mkdir()
    stand_in_run(empty, checkpoint=False)
    import yaml

    export = tmp_path / "export"  # an image model's export: its run's config in config.json (was refused after start-up)
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"config": yaml.safe_load((image / "config.yaml").read_text()),
                                                    "step": 1, "dtype": "float32", "checkpoint": "x"}))
    for d, line in ((image, f"{image}: model.name=dit makes images, not text: lm-eval scores language models"),
                    (export, f"{export}: model.name=dit makes images, not text: lm-eval scores language models"),
                    (empty, f"{empty} has no checkpoint yet ({empty / 'checkpoints'} holds none): nothing to evaluate")):
        assert lm_eval.main(["-M", "nljax", "--model_args", f"run_dir={d}", "--tasks", "a"]) == 2
        assert capsys.readouterr().err.strip() == f"nljax.lm_eval: error: {line}"


def test_an_output_path_in_a_folder_it_cannot_write_is_one_line_before_its_start_up(tmp_path, never_started, capsys,
                                                                                      monkeypatch):
    """--output_path in a folder this user cannot write, or that folder itself (its permissions, a
    read-only mount): one line and exit 2 before lm-eval's start-up, nothing written."""
    from nljax import lm_eval

    run = tmp_path / "run"
    run.mkdir()
    stand_in_run(run)
    locked = tmp_path / "locked"
    locked.mkdir()
    lock(locked, monkeypatch)
    try:
        for out, said in ((locked, f"{locked}"), (locked / "out", f"{locked / 'out'}: {locked}")):
            capsys.readouterr()
            assert lm_eval.main(["--model", "nljax", "--model_args", f"run_dir={run}", "--tasks", "a",
                                 "--output_path", str(out)]) == 2
            assert capsys.readouterr().err.strip() == f"nljax.lm_eval: error: --output_path {said} is not writable"
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_lm_evals_abbreviated_options_are_read_as_it_reads_them(tmp_path, never_started, capsys):
    """lm-eval's parser takes an option's unambiguous prefix (`--task a`): the early checks read
    it alike, neither refusing what lm-eval runs ("--tasks is missing") nor passing what they
    refuse spelt out."""
    from nljax import lm_eval

    run = tmp_path / "run"
    run.mkdir()
    stand_in_run(run)
    base = ["--model", "nljax", "--model_args", f"run_dir={run}"]
    with pytest.raises(AssertionError, match="lm-eval started"):
        lm_eval.main([*base, "--task", "a"])
    capsys.readouterr()
    for args, line in ((["--task", "a", "--lim", "0"], "--limit 0: give a number of examples per task (>= 1) or a "
                                                        "fraction of them (between 0 and 1)"),
                       (["--task", "a", "--batch", "0"], "batch_size must be >= 1, got 0")):
        assert lm_eval.main([*base, *args]) == 2, args
        assert capsys.readouterr().err.strip() == f"nljax.lm_eval: error: {line}"


@pytest.mark.parametrize("error", ["ConnectionError", "OfflineModeIsEnabled"])
def test_a_tasks_data_out_of_reach_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, error):
    """A task whose data `datasets` cannot fetch (the Hub out of reach, or offline: simulated, no
    download here) is a refused input: one line pointing to a task of one's own, exit 2 (a
    traceback's last line and exit 1 before); an OSError raised elsewhere is not: it passes."""
    import datasets
    from huggingface_hub.errors import OfflineModeIsEnabled
    from lm_eval import __main__ as lm_eval_main
    from lm_eval.tasks import TaskManager

    from nljax import lm_eval

    kind = ConnectionError if error == "ConnectionError" else OfflineModeIsEnabled

    def unreachable(*args, **kwargs):  # as datasets.load_dataset raises it
        raise kind("Couldn't reach 'EleutherAI/wikitext_document_level' on the Hub (LocalEntryNotFoundError)")

    tasks = write_tasks(tmp_path / "tasks")
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    # lm-eval as far as it builds the task (ConfigurableTask.download): the model is not the test's
    monkeypatch.setattr(lm_eval_main, "cli_evaluate",
                        lambda: TaskManager(include_path=str(tasks), include_defaults=False).load(["tiny_mc"]))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    stand_in_run(tmp_path)
    argv = ["--model", "nljax", "--model_args", f"run_dir={tmp_path}", "--tasks", "tiny_mc", "--include_path",
            str(tasks)]
    assert lm_eval.main(argv) == 2
    assert capsys.readouterr().err.strip() == lm_eval.STARTING + "\n" + (
        "nljax.lm_eval: error: a task's data cannot be read: Couldn't reach 'EleutherAI/wikitext_document_level' on "
        "the Hub (LocalEntryNotFoundError) (lm-eval downloads a standard task's data from the Hugging Face Hub once, "
        "then reads its cache; without the network, a task of your own reads local files: docs/guides/evaluation.md, "
        "\"A task of your own, nothing downloaded\")")
    # the guide has that section
    assert "### A task of your own, nothing downloaded" in (ROOT / "docs" / "guides" / "evaluation.md").read_text()
    monkeypatch.setattr(lm_eval_main, "cli_evaluate", unreachable)  # not raised building a task
    assert lm_eval.main(argv) == 1


def test_lm_evals_git_describe_says_nothing_outside_a_repository(tmp_path, monkeypatch, capfd):
    """lm-eval records `git describe` in its results; outside a repository git's `fatal: not a
    git repository` went to standard error. The command holds it back (the hash is the same)."""
    from lm_eval import __main__ as lm_eval_main
    from lm_eval import evaluator
    from lm_eval.loggers.utils import get_git_commit_hash

    from nljax import lm_eval

    got = []
    monkeypatch.setattr(lm_eval_main, "cli_evaluate", lambda: got.append(evaluator.get_git_commit_hash()))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.chdir(tmp_path)  # no repository here
    capfd.readouterr()
    assert lm_eval.main(["--model", "hf", "--tasks", "x"]) == 0
    assert got == [None] and capfd.readouterr().err == lm_eval.STARTING + "\n"  # git's line held back
    monkeypatch.chdir(ROOT)  # a repository (a checkout): the same hash as lm-eval's own
    assert lm_eval.git_hash() == get_git_commit_hash()


def test_results_are_named_after_the_run_dir(tmp_path, monkeypatch):
    """lm-eval names a model's results, and their folder under --output_path, by --model_args'
    `pretrained=`, `path=`, ...; nljax's `run_dir=` is none of them, so every result went to a
    folder of a random name (`out/i82qcls7/`). The command reads run_dir= as the name, as
    `pretrained=org/name` is a Hugging Face model's (`out/org__name/`); other models keep theirs."""
    from lm_eval import __main__ as lm_eval_main
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker

    from nljax import lm_eval

    run = tmp_path / "runs" / "exp1"
    run.mkdir(parents=True)
    stand_in_run(run)
    got = []
    monkeypatch.setattr(lm_eval_main, "cli_evaluate", lambda: got.append([
        GeneralConfigTracker._get_model_name(args) for args in
        ({"run_dir": str(run), "batch_size": 2}, f"run_dir={run},batch_size=2", {"pretrained": "org/name"}, {})]))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert lm_eval.main(["--model", "nljax", "--model_args", f"run_dir={run}", "--tasks", "x"]) == 0
    assert got == [[str(run), str(run), "org/name", None]]
    assert GeneralConfigTracker._get_model_name({"run_dir": "x"}) is None  # lm-eval's own, outside the command
    # an lm-eval 0.4 release whose _get_model_name says "" for none (pyproject takes any 0.4)
    assert lm_eval.model_name(lambda args: "")(f"run_dir={run},batch_size=2") == str(run)


def test_a_tokenizer_run_is_scored_with_its_tokens(tmp_path):
    """A run on its own files with a tokenizer.json, evaluated from its export: the requests are
    the tokenizer's tokens (the context's, then those of context + continuation after as many
    tokens as the context has: lm-eval's split for causal models), a rolling request starts with
    the document-end token, and the scores are nljax's own."""
    import jax
    from lm_eval.api.instance import Instance

    from nljax import export
    from nljax.lm_eval import FromRun
    from nljax.run import trained as trained_lib

    from tokenizers import Tokenizer

    files = bpe_corpus(tmp_path, "document {i} says hello to the tokenizer, number {sq}. ")
    tok = Tokenizer.from_file(str(tmp_path / "tok.json"))
    saved_run(tmp_path / "run", [*NL, *files], 1, 1, steps=0)  # the initial parameters: no step compiled
    out = export.export(trained_lib.load(tmp_path / "run", devices=jax.devices()[:1]), tmp_path / "export")
    lm = nljax.load(out)
    model = FromRun(run_dir=str(out), batch_size=2)
    context, continuation = "document 3 says hel", "lo to the tokenizer"  # "hello" is one token: split by lm-eval
    ctx, whole = lm.encode(context), lm.encode(context + continuation)
    assert whole[: len(ctx)] != ctx or len(whole) < len(ctx) + len(lm.encode(continuation))  # the boundary merges
    text = "document 5 says hello to the tokenizer, number 25. " * 3
    (got, _), = model.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    (rolled,) = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    cont = whole[len(ctx) :]  # lm-eval's split: the tokens of the whole after the context's count
    assert got == pytest.approx(float(own_logprobs(lm, ctx + cont)[-len(cont) :].sum()), rel=1e-5)
    assert lm.end_id == tok.token_to_id("<eos>") and max(lm.encode(text)) > 255
    assert rolled == pytest.approx(float(own_logprobs(lm, [lm.end_id, *lm.encode(text)]).sum()), rel=1e-5)


class Scripted:
    """A stream reader whose rows draw the tokens of a script (`StreamReader.generate`'s contract:
    `stop` asked after each token but the budget's last; a row it stops is not extended)."""

    def __init__(self, scripts):
        self.scripts, self.drawn = scripts, []

    def generate(self, prompts, max_new_tokens, pick, stop):
        out = []
        for i, script in enumerate(self.scripts):
            tokens = []
            for token in script[:max_new_tokens]:
                tokens.append(token)
                if len(tokens) >= max_new_tokens or stop(i, tokens):
                    break
            out.append(tokens)
        self.drawn = [len(t) for t in out]
        return out


def test_generate_until_ends_as_lm_evals_hugging_face_model():
    """generate_until ends an answer as lm-eval's HFLM: at the end token (not part of it), before
    the first of `until` and the end token's text, or after max_gen_toks; a row that has ended
    draws no more. It is nljax.generate's Ending, each token read once as it comes: the stop
    check decoded the whole answer again after every token (a decoding per token per request)."""
    from lm_eval.api.instance import Instance

    from nljax.data.tokenization import Bytes
    from nljax.run.harness_model import NLJaxLM, Reading

    asks = [({"until": ["\n\n"]}, b"ab\0cd"),  # the end token: "ab"
            ({"until": ["yz", "xyz"], "max_gen_toks": 9}, b"axyzq"),  # both at once: the earlier
            ({"until": "zz", "max_gen_toks": 3}, b"abczz"),  # a str; max_gen_toks first
            ({"until": ["", "c"]}, b"abc\0"),  # an empty stop string, which lm-eval skips, is no stop
            ({}, b"xyz")]  # no until: the script's end
    reader = Scripted([script for _, script in asks])
    model = NLJaxLM(Reading(reader, Bytes(), "scripted"), progress=False)
    reqs = [Instance("generate_until", {}, ("ctx", kwargs), i) for i, (kwargs, _) in enumerate(asks)]
    with mock.patch.object(Bytes, "decode", autospec=True, side_effect=Bytes.decode) as decode:
        got = model.generate_until(reqs)
    assert got == ["ab", "a", "abc", "ab", "xyz"]
    assert reader.drawn == [3, 4, 3, 3, 3]  # up to the end token, the stop string's end, the budget
    assert decode.call_count <= 1  # the end token's text, once: no answer decoded whole


def test_generate_until_drops_special_tokens_as_lm_evals_hugging_face_model(tmp_path):
    """An answer is decoded as HFLM's `tok_decode` decodes one, without the tokenizer's special
    tokens (`skip_special_tokens=True`; it kept them, `<sep>` in the answer), and cut before the
    first `until` string of that text; the stop check still reads them (a special token's text in
    `until`, a chat template's `<|im_end|>`, ends the answer there, as HFLM's stopping criteria)."""
    from lm_eval.api.instance import Instance
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from nljax.data import tokenization
    from nljax.run.harness_model import NLJaxLM, Reading

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "\u2581the": 1, "\u2581quick": 2, "\u2581fox": 3},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.add_special_tokens(["<eos>", "<sep>", "<|im_end|>"])  # ids 4, 5, 6
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = tokenization.load(str(tmp_path / "tokenizer.json"), "<eos>")
    asks = [({}, [2, 5, 3, 4]),  # <sep> inside: dropped; the end token ends it
            ({"until": ["<|im_end|>"]}, [2, 6, 3, 1]),  # a special token's text in until: the answer ends there
            ({"until": ["quick fox"]}, [2, 5, 3, 1]),  # in the text without <sep>: cut there, as HFLM's
            ({"until": ["fox"]}, [2, 3, 1])]  # no special token drawn: the text as it was
    reader = Scripted([script for _, script in asks])
    model = NLJaxLM(Reading(reader, codec, "scripted"), progress=False)
    reqs = [Instance("generate_until", {}, ("the", kwargs), i) for i, (kwargs, _) in enumerate(asks)]
    assert model.generate_until(reqs) == [" quick fox", " quick", " ", " quick "]
    assert reader.drawn == [4, 2, 4, 2]  # the end token, <|im_end|>'s, the script's end, fox's


def test_generate_untils_stop_check_decodes_once_per_token(tmp_path):
    """`tok_decode` (lm-eval's; generate_until's stop check used it after every generated token,
    until it read each token once with nljax.generate's Ending): with a tokenizer.json it decoded
    the whole sequence again per token (`decode_stream` joined): 12 s of host time per 256-token
    answer after a 2,000-token prompt. Now two decodings, the same text."""
    from nljax.data import tokenization
    from nljax.run.harness_model import NLJaxLM, Reading

    bpe_corpus(tmp_path, "document {i} says hello to the tokenizer, number {sq}. ")
    codec = tokenization.load(str(tmp_path / "tok.json"), "<eos>")
    prompt, answer = codec.encode("document 7 says"), codec.encode(" hello to the tokenizer, number 49. " * 6)
    lm = NLJaxLM(Reading(None, codec, "test"), progress=False)
    want = "".join(codec.decode_stream(answer, context=prompt))
    codec.tok = mock.Mock(wraps=codec.tok)  # counts the tokenizer's decodings
    assert lm.tok_decode(answer, prompt) == want and len(answer) > 30 and codec.tok.decode.call_count <= 2


def test_a_rolling_task_without_a_document_end_token_is_refused_at_start_up(tmp_path, local_tasks_only):
    """A rolling task reads each text after the run's document-end token: with a tokenizer that
    has none, the run stopped at its first evaluation (after its last checkpoint); now `attach`
    refuses it in one line before anything is written. A multiple choice task still runs there."""
    from helpers import make

    from nljax.run import harness

    tasks = write_tasks(tmp_path / "tasks")
    files = [o for o in bpe_corpus(tmp_path, "document {i} says hello, number {sq}. ") if "doc_end_token" not in o]
    setup = make([*NL, *files, "eval.harness_tasks=[tiny_mc,tiny_roll]", f"eval.harness_include={tasks}"])
    with pytest.raises(ConfigError, match=r"^eval.harness_tasks: tiny_roll \(loglikelihood_rolling\) reads each "
                                          r"text after the run's document-end token, .* set data.doc_end_token$"):
        harness.attach(setup.run)
    cfg = setup.run.cfg
    mc_only = dataclasses.replace(setup.run, cfg=dataclasses.replace(
        cfg, eval=dataclasses.replace(cfg.eval, harness_tasks=("tiny_mc",))))
    assert harness.attach(mc_only).harness is not None


def test_the_stream_reader_scores_a_stream_of_fewer_than_two_tokens_as_nothing(lm):
    """A stream of n tokens scores n - 1: an empty one gave the padding's window-long scores
    (n - 1 = -1 sliced all but the last); a generation from no token read position -1 (the
    window's padding). The harness never sends either; the reader itself now answers or refuses."""
    import jax

    from nljax.parallel.mesh import make_mesh
    from nljax.run.scoring import StreamReader

    reader = StreamReader(lm.model, lm.params, make_mesh(1, 1, jax.devices()[:1]), lm.seq_len, lm.end_id, 2,
                          vocab=lm.config.model.vocab_size)
    out = reader.score([[], [5], [5, 6, 7]])
    assert [(len(logp), len(hits)) for logp, hits in out] == [(0, 0), (0, 0), (2, 2)]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        reader.generate([[5], []], 3, lambda logits, i: 0, lambda i, tokens: False)
    # a reader asked for no rows reads one at a time, as the one of two does
    one = StreamReader(lm.model, lm.params, make_mesh(1, 1, jax.devices()[:1]), lm.seq_len, lm.end_id, 0,
                       vocab=lm.config.model.vocab_size)
    assert one.rows == 1
    # max_new_tokens tokens at most, stop or not
    assert one.generate([[5], [5, 6]], 3, lambda logits, i: 7, lambda i, tokens: False) == [[7, 7, 7], [7, 7, 7]]
    np.testing.assert_allclose(one.score([[5, 6, 7]])[0][0], out[2][0], rtol=1e-5)
