"""Evaluate a trained model with EleutherAI's lm-evaluation-harness.

    python -m nljax.lm_eval --model nljax --model_args run_dir=runs/default --tasks lambada_openai
    python -m nljax.lm_eval --model nljax --model_args run_dir=runs/default,checkpoint=2000,batch_size=16 \\
        --tasks mytask --include_path my_tasks/ [--cpu-devices N] [any other lm_eval option]

lm-eval 0.4 has no plugin door for models (its registry lists the models of its own package), so
this command enters nljax's model in lm-eval's registry as `nljax` and then runs lm-eval's own
command line with the other arguments: every `lm_eval` option works as documented there. From
Python, `nljax.lm_eval.register()` before `lm_eval.simple_evaluate(model="nljax", ...)` does the
same. `--model_args`: run_dir=DIR (a run directory that nljax.train wrote, or an export
directory), checkpoint=latest|STEP|PATH (a run's checkpoint: its step number or step directory),
params=average|trained (under optim.ema_decay: the parameters' moving average, the default, or
the optimizer's own), batch_size=N (requests read at once; lm-eval's --batch_size too). The model reads on every local
device (`--cpu-devices N` emulates N on a CPU), the requests' rows split over them; the scores are
the same on any count. How requests are read: nljax/run/harness_model.py.

lm-eval is an optional extra: `pip install 'nljax[lm-eval]'` (in a checkout of nljax: `pip
install -e '.[lm-eval]'`). Without it `--help` prints this command's own options and a run is
one line (exit 2), as is a task lm-eval does not know, a task whose data cannot be fetched,
and bad --model_args (checked before lm-eval's start-up).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from unittest import mock

from nljax import cli
from nljax.errors import ConfigError, first_line
from nljax.run.harness import INSTALL, unloadable
from nljax.writable import refuse_unwritable

_missing = None  # the command run without lm-eval: why it could not be imported
try:  # the model class is lm-eval's `TemplateLM`
    from nljax.run.harness_model import NAME, NLJaxLM, Reading
except ImportError as e:
    if __name__ != "__main__":  # `from nljax.lm_eval import FromRun` needs lm-eval: its own error
        raise
    # the command: its --help still reads, then one line (main); FromRun below is never made
    _missing, NLJaxLM = first_line(e), object
from nljax.run.scoring import StreamReader

DEFAULT_ROWS = 8  # requests per batch when neither batch_size= nor --batch_size says (rounded up to the devices)


class FromRun(NLJaxLM):
    """`--model nljax`: the model of a run or export directory, built from --model_args."""

    def __init__(self, run_dir: str = "", checkpoint: str | int = "latest", batch_size: int | str | None = None,
                 params: str = "", **options):
        check_keys(options)
        super().__init__(load(str(run_dir), checkpoint, rows(batch_size), str(params)))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "FromRun":
        """lm-eval's options under --model_args': batch_size= there wins over --batch_size (whose
        default, 1, lm-eval always passes; its own classes would take both and fail)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "FromRun":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)


KEYS = ("run_dir", "checkpoint", "batch_size", "params")  # FromRun's own --model_args
# lm-eval passes its own options to every model: the device and the batch limit are JAX's and ours
PASSED = ("device", "max_batch_size")


def check_keys(options) -> None:
    """One line for --model_args keys that are neither `KEYS` nor lm-eval's `PASSED`."""
    unknown = sorted(set(options) - set(KEYS) - set(PASSED))
    if unknown:
        raise ConfigError(f"--model_args: unknown key(s) {', '.join(unknown)} for --model {NAME} (it takes "
                          "run_dir=, checkpoint=, params= and batch_size=)")


def check_early(lm_eval_argv: list[str]) -> None:
    """`--model nljax`'s --model_args checked as FromRun will check them (the keys, run_dir= a
    run or export directory, batch_size=), before lm-eval's start-up (its imports, its index of
    its thousands of tasks, the tasks' data: 20 s and more) rather than after it. Parsed as
    lm-eval parses them (its own action); an lm-eval without that action is left to its check."""
    import argparse

    try:
        from lm_eval._cli.utils import MergeDictAction
    except ImportError:  # another lm-eval 0.4 layout: FromRun checks them, later
        return
    # Abbreviations read as lm-eval reads them (`--task a`, `--lim 5`: its parser allows them): these
    # options are some of its own, so a prefix that names one of its options names the same one
    # here (without them, `--task a` was refused as "--tasks is missing")
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", "-M", "-m")  # -M in lm-eval 0.4.9 and later, -m before
    p.add_argument("--model_args", "-a", nargs="+", action=MergeDictAction)
    p.add_argument("--config", "-C")  # a YAML of lm-eval's options, --tasks among them
    p.add_argument("--tasks", "-t", nargs="+")
    p.add_argument("--limit", "-L")
    p.add_argument("--batch_size", "-b")
    p.add_argument("--output_path", "-o")
    p.add_argument("--include_path")
    try:
        args, _ = p.parse_known_args(lm_eval_argv)
    except (SystemExit, ValueError, TypeError):  # not ours to word: lm-eval's parser says it
        return
    if runs(lm_eval_argv):  # not `ls tasks` or `validate --tasks ...`
        check_lm_eval_options(args)
    if args.model != NAME:
        return
    given = args.model_args or {}
    check_keys(given)
    # batch_size= under --model_args wins over --batch_size (create_from_arg_obj)
    rows(given.get("batch_size", args.batch_size))
    path = str(given.get("run_dir", ""))
    need_run_dir(path)
    from nljax import config
    from nljax.checkpoint import storage
    from nljax.models import registry
    from nljax.run.trained import checkpoint_path, reads_average, trained_config
    from nljax.runtime.exportdir import CONFIG
    from nljax.runtime.rundir import checkpoint_dir
    from nljax.trained_model import check_export_args, kind_of

    where = Path(os.path.expanduser(path))
    checkpoint, params = given.get("checkpoint", "latest"), str(given.get("params", ""))
    export = kind_of(where) == "export"  # one line where it is neither
    if export:
        check_export_args(where, checkpoint, params=params)
        cfg = config.from_dict(json.loads((where / CONFIG).read_text())["config"])  # its run's, as `load` reads it
    else:
        checkpoint_path(where, checkpoint)  # a step the run has no checkpoint at: one line, with the steps it has
        cfg = trained_config(where)
        reads_average(params, cfg, where / "config.yaml")  # params=average of a run that keeps no average
    if registry.task_of(cfg) != "text":  # refused by `load` too, after lm-eval's start-up
        raise ConfigError(image_model(path, cfg.model.name))
    if not export and str(checkpoint) == "latest":
        root = checkpoint_dir(cfg)
        if not storage.committed_steps(root):  # "checkpoint not found", after lm-eval's start-up
            raise ConfigError(f"{path} has no checkpoint yet ({root} holds none): nothing to evaluate")


SUBCOMMANDS = ("run", "ls", "validate")  # lm-eval's; without one, arguments are `run`'s


def runs(argv: list[str]) -> bool:
    """Whether lm-eval's command line runs an evaluation, as its HarnessCLI reads it: `run ...`, or
    two or more arguments without a subcommand (one alone prints its help, as `run` alone prints
    run's: the list of lm-eval's options, which `--help` here would not reach)."""
    return argv[0] == "run" and len(argv) > 1 if argv and argv[0] in SUBCOMMANDS else len(argv) > 1


def check_lm_eval_options(args) -> None:
    """lm-eval's own options that it would fail on with a traceback (exit 1) or, for
    --output_path, not at all (a warning after the whole evaluation, the results not written):
    each one line here, before its start-up."""
    tasks = args.tasks or []
    if args.tasks is None and args.config is None:  # lm-eval: "No tasks specified", a traceback
        raise ConfigError("--tasks is missing: name lm-eval's tasks (--tasks lambada_openai,hellaswag; `lm_eval ls "
                          "tasks` lists them)")
    names = [t for arg in tasks for t in arg.split(",")]  # lm-eval splits each word at its commas
    if any(not t for t in names):  # "" is lm-eval's "no tasks", then its ValueError with no name
        raise ConfigError(f"--tasks {' '.join(tasks)!r} holds an empty task name (names are separated by commas, "
                          "or by spaces as separate words: --tasks a,b or --tasks a b)")
    spaced = [t for t in names if t != t.strip()]
    if spaced:  # "a, b" quoted as one word: lm-eval looks for a task " b"
        raise ConfigError(f"--tasks: task name {spaced[0]!r} has spaces around it (write --tasks a,b or --tasks a b)")
    if args.limit is not None:
        try:
            limit = float(args.limit)
        except ValueError:  # lm-eval's parser says it, in its usage line
            limit = None
        if limit is not None and not limit > 0:  # 0: no documents, -1: islice's ValueError, both tracebacks
            raise ConfigError(f"--limit {args.limit}: give a number of examples per task (>= 1) or a fraction of "
                              "them (between 0 and 1)")
    if args.include_path and not Path(os.path.expanduser(args.include_path)).is_dir():
        # lm-eval indexes the YAML files under it: none under a file or a missing path, and its
        # tasks were then "unknown", with advice to give the --include_path just given
        raise ConfigError(f"--include_path {args.include_path} is not a directory (of lm-eval task YAML files)")
    if args.output_path:
        # lm-eval writes OUT/<model>/results_<time>.json, or OUT_<time>.json beside OUT=NAME.json,
        # making the directories; one it cannot make is a warning after the evaluation, and exit 0
        out, named = Path(os.path.expanduser(args.output_path)), f"--output_path {args.output_path}"
        if out.suffix == ".json" and os.path.lexists(out):  # an earlier result: kept, the new one written beside it
            out, named = out.parent, f"{named}: {out.parent}"
        refuse_unwritable(named, out)


def image_model(path: str, name: str) -> str:
    return f"{path}: model.name={name} makes images, not text: lm-eval scores language models"


def need_run_dir(path: str) -> None:
    if not path:
        raise ConfigError(f"--model {NAME} needs --model_args run_dir=DIR (a run directory nljax.train wrote, or an "
                          "export directory)")


def rows(batch_size: int | str | None) -> int:
    """Requests per batch from batch_size= or --batch_size (a number; "auto": the default)."""
    if batch_size in (None, "") or str(batch_size).startswith("auto"):
        return DEFAULT_ROWS
    try:
        n = int(batch_size)
    except ValueError:
        raise ConfigError(f"batch_size={batch_size!r} is not a number of requests per batch") from None
    if n < 1:
        raise ConfigError(f"batch_size must be >= 1, got {n}")
    return n


def load(path: str, checkpoint: str | int, n_rows: int, params: str = "") -> Reading:
    """The reading of a run or export directory (`nljax.load`), its parameters replicated over
    this process's devices."""
    import jax

    import nljax
    from nljax.parallel.mesh import make_mesh, replicated

    need_run_dir(path)
    lm = nljax.load(path, checkpoint, params=params)
    if not lm.makes_text:
        raise ConfigError(image_model(path, lm.config.model.name))
    mesh = make_mesh(1, -1, jax.local_devices())
    params = jax.device_put(lm.params, replicated(mesh))
    reader = StreamReader(lm.model, params, mesh, lm.seq_len, lm.end_id, n_rows, vocab=lm.config.model.vocab_size)
    return Reading(reader, lm.tokenizer, f"{path} (step {lm.step})")


def register() -> None:
    """Enter `FromRun` in lm-eval's model registry as "nljax", after lm-eval's own models (which
    lm-eval enters only while its registry is empty)."""
    import lm_eval.models  # noqa: F401 - lm-eval's own models, entered first
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=FromRun)


def main(argv=None) -> int:
    """`--cpu-devices N` is this command's; every other argument goes to lm-eval's command line."""
    argv = cli.listed(argv)
    if cli.not_listed("nljax.lm_eval", argv):  # a str was read letter by letter: "--tasks is missing"
        return 2
    mine = {i for i, a in enumerate(argv) if a in ("-h", "--help") or a.startswith("--cpu-devices")
            or (i and argv[i - 1] == "--cpu-devices")}
    own, rest = [argv[i] for i in sorted(mine)], [a for i, a in enumerate(argv) if i not in mine]
    theirs = "Every other argument is lm-eval's (`lm_eval run --help` lists them)"
    if _missing is not None:  # the help reads before lm-eval is installed
        theirs = f"lm-eval is not installed ({_missing}): {INSTALL}. Once it is, e{theirs[1:]}"
    p = cli.Parser(allow_abbrev=False, prog="nljax.lm_eval", description=__doc__.splitlines()[0],
                   epilog=f"{theirs}: --model nljax --model_args run_dir=DIR[,checkpoint=STEP][,batch_size=N] "
                          "--tasks ... [--include_path DIR] [--limit N] [--output_path DIR] ...")
    p.add_argument("--cpu-devices", type=int, metavar="N", help="emulate N devices on the CPU")
    args = cli.parse(p, own, intermixed=False)
    if isinstance(args, int):  # refused, or --help
        return args
    return cli.tool("nljax.lm_eval", lambda: _evaluate(args.cpu_devices, rest))


def _evaluate(cpu_devices: int | None, lm_eval_argv: list[str]) -> int:
    if _missing is not None:  # refused, as the environment it needs is not there
        raise ConfigError(f"lm-eval is not installed ({_missing}): {INSTALL}")
    cli.setup_devices(cpu_devices)
    check_early(lm_eval_argv)
    lm_eval_argv = expand_home(lm_eval_argv)
    # lm-eval's start-up (its imports, torch's among them, and the index of its thousands of tasks)
    # takes 20 to 35 s on a 2-core CPU before its first log line: said, once the arguments are checked
    print(STARTING, file=sys.stderr, flush=True)
    register()
    from lm_eval import evaluator
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker

    try:
        # lm-eval's `git describe` (its results' git_hash) says `fatal: not a git repository` on
        # standard error outside one: the same hash, without the stray line. Its results name the
        # model (and its folder under --output_path) by --model_args' `pretrained=`, `path=`, ...:
        # `run_dir=` is none of them, so each result went to a folder of a random name. Its command
        # line is read from sys.argv, given back after it (a notebook's kernel keeps its own).
        with (mock.patch.object(evaluator, "get_git_commit_hash", git_hash),
              mock.patch.object(GeneralConfigTracker, "_get_model_name",
                                staticmethod(model_name(GeneralConfigTracker._get_model_name))),
              mock.patch.object(sys, "argv", ["lm_eval", *lm_eval_argv])):
            cli_evaluate()
    except SystemExit as e:  # lm-eval's argparse (an option it does not know): its code, as nljax's refusals
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    except ValueError as e:
        tasks = unknown_tasks(e)
        if tasks is None:
            raise
        raise ConfigError(f"unknown task(s): {tasks} (`lm_eval ls tasks` lists lm-eval's; a task of your own: "
                          f"--include_path DIR){unloadable(option(lm_eval_argv, '--include_path'))}") from None
    except OSError as e:
        if not unreadable_data(e):
            raise
        raise ConfigError(f"a task's data cannot be read: {first_line(e) or type(e).__name__} ({UNREADABLE})") from None
    return 0


PATHS = ("--include_path", "--output_path", "-o")  # lm-eval's options that name a file or directory


def expand_home(argv: list[str]) -> list[str]:
    """`--include_path=~/tasks` as the shell leaves it (it expands `~` at a word's start only),
    expanded for lm-eval, which would open a directory named `~` (the checks above read it expanded)."""
    out = []
    for i, a in enumerate(argv):
        opt, eq, value = a.partition("=")
        if eq and opt in PATHS:
            a = f"{opt}={os.path.expanduser(value)}"
        elif i and argv[i - 1] in PATHS:  # a value quoted as its own word: "~/tasks"
            a = os.path.expanduser(a)
        out.append(a)
    return out


def option(argv: list[str], name: str) -> str | None:
    """The last value of option `name` in `argv` (`name VALUE` or `name=VALUE`), or None."""
    found = None
    for i, a in enumerate(argv):
        if a.startswith(name + "="):
            found = a.split("=", 1)[1]
        elif a == name and i + 1 < len(argv):
            found = argv[i + 1]
    return found


STARTING = "nljax.lm_eval: starting lm-evaluation-harness (its imports and its index of tasks: 20 s and more) ..."

# where a task's data that Hugging Face's libraries cannot fetch is refused: what to do instead
UNREADABLE = ("lm-eval downloads a standard task's data from the Hugging Face Hub once, then reads its cache; "
              "without the network, a task of your own reads local files: docs/guides/evaluation.md, "
              "\"A task of your own, nothing downloaded\"")


def unreadable_data(e: OSError) -> bool:
    """Whether `e` is a task's data that `datasets` or the Hub could not fetch (the Hub out of
    reach, offline mode, no such dataset), raised as lm-eval built a task: an input the command
    refuses (exit 2), as an unknown task is; any other OSError (a full disk) is not."""
    kinds: tuple[type, ...] = (ConnectionError,)  # datasets' "Couldn't reach ..."; the Hub's OfflineModeIsEnabled
    try:
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        kinds += (HfHubHTTPError, LocalEntryNotFoundError)
    except ImportError:
        pass
    try:
        from datasets.exceptions import DatasetNotFoundError

        kinds += (DatasetNotFoundError,)
    except ImportError:
        pass
    task = f"{os.sep}lm_eval{os.sep}api{os.sep}task.py"  # ConfigurableTask.download: datasets.load_dataset
    return isinstance(e, kinds) and any(f.filename.endswith(task) for f in traceback.extract_tb(e.__traceback__))


def model_name(theirs):
    """lm-eval's `_get_model_name(model_args)` (`theirs`), with nljax's `run_dir=` read as the
    model's name where none of the keys it looks for is given, as `pretrained=org/name` is for a
    Hugging Face model: results of `--output_path DIR` go to `DIR/runs__exp1/` (its sanitized
    form), and their `model_name` says which run was scored."""

    def name(model_args):
        found = theirs(model_args)  # none of its keys given: None, or "" in earlier 0.4 releases
        if not found and isinstance(model_args, str):
            from lm_eval.utils import simple_parse_args_string

            model_args = simple_parse_args_string(model_args)
        if not found and isinstance(model_args, dict) and model_args.get("run_dir"):
            found = str(model_args["run_dir"])
        return found

    return name


def git_hash() -> str | None:
    """lm-eval's `get_git_commit_hash` with git's own error line held back."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):  # not a repository; git not installed
        return get_commit_from_path(os.getcwd())


def unknown_tasks(e: ValueError) -> str | None:
    """The tasks of lm-eval's own "Tasks not found: a, b" (a plain ValueError, raised as it
    matches --tasks), or None for any other error, which is not this command's to describe."""
    m = re.fullmatch(r"Tasks not found: (.+)", str(e))
    frames = traceback.extract_tb(e.__traceback__)
    raised_by_lm_eval = bool(frames) and f"{os.sep}lm_eval{os.sep}" in frames[-1].filename
    return m[1] if m and raised_by_lm_eval else None


if __name__ == "__main__":
    cli.leave(main())
