"""`eval.harness_tasks`: lm-evaluation-harness tasks run at every evaluation of a training run, on
the parameters it is training, their metrics logged beside `eval_bpb` (metrics.jsonl, the
trackers, the progress line) as `harness_<task>_<metric>`.

The tasks are checked at start-up, before anything is written: lm-eval missing, a task lm-eval
does not know, one whose data cannot be read, or a rolling task without a document-end token to
start from stops the run with one line. Each evaluation
reads the first `eval.harness_limit` examples of each task with nljax's lm-eval model
(nljax/run/harness_model.py) on the whole mesh: `train.batch_size` requests at a time, the
parameters gathered over the data axes as for the text samples, every process running the same
programs (the scores are replicated, so each reads its own copy). The forward is compiled once.

lm-eval is imported here only when the run names tasks: a run without them never loads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import time
from pathlib import Path
from typing import Any

from nljax.errors import ConfigError, first_line
from nljax.run.core import Run
from nljax.run.sampling import tokenization_of

# How to install lm-eval, said wherever it is missing: a wheel's extra, and a checkout's
INSTALL = "pip install 'nljax[lm-eval]' (in a checkout of nljax: pip install -e '.[lm-eval]')"
FEWSHOT_SEED = 1234  # lm_eval.simple_evaluate's default: few-shot examples drawn as the harness draws them


def attach(run: Run) -> Run:
    """`run` with its harness evaluation when `eval.harness_tasks` names tasks (checked here, one
    line for what is wrong), else `run` itself."""
    e = run.cfg.eval
    if not e.harness_tasks:
        return run
    if run.task.unit != "tokens":
        raise ConfigError(f"eval.harness_tasks scores language models; model.name={run.cfg.model.name} makes images")
    try:
        from nljax.run import harness_model
    except ImportError as err:
        raise ConfigError(f"eval.harness_tasks needs lm-eval ({first_line(err)}): {INSTALL}") from None
    manager = task_manager(list(e.harness_tasks), e.harness_include)
    with quiet():
        try:
            # reads each task's data now: a failure stops the run before step 0
            loaded = manager.load(list(e.harness_tasks))
        except Exception as err:  # noqa: BLE001 - lm-eval and `datasets` raise their own types
            raise ConfigError(f"eval.harness_tasks: cannot load {', '.join(e.harness_tasks)}: "
                              f"{first_line(err) or type(err).__name__}") from None
    codec = tokenization_of(run.cfg)
    check_start_token(loaded["tasks"], codec.end_id)
    return dataclasses.replace(run, harness=HarnessEval(run, manager, harness_model, codec))


def check_start_token(tasks: dict, end_id: int | None) -> None:
    """A rolling-loglikelihood task's texts start from the run's document-end token
    (`NLJaxLM.prefix_token_id`): without one, refused now, not at the first evaluation (which
    would stop the run there, after its last checkpoint)."""
    rolling = sorted(name for name, task in tasks.items() if task.get_config("output_type") == "loglikelihood_rolling")
    if rolling and end_id is None:
        raise ConfigError(f"eval.harness_tasks: {', '.join(rolling)} (loglikelihood_rolling) reads each text after "
                          "the run's document-end token, and this run's tokenizer has none: set data.doc_end_token")


def task_manager(tasks: list[str], include: str):
    """lm-eval's TaskManager for `tasks`: of `include` alone when it holds them all (indexing
    lm-eval's own thousands of task files takes many seconds), else of both; one line naming the
    tasks it does not know."""
    from lm_eval.tasks import TaskManager

    if include and not Path(os.path.expanduser(include)).is_dir():
        raise ConfigError(f"eval.harness_include={include} is not a directory (of lm-eval task YAML files)")
    include = str(Path(os.path.expanduser(include))) if include else None
    with quiet():
        manager = TaskManager(include_path=include, include_defaults=False) if include else None
        if manager is None or set(manager.match_tasks(tasks)) != set(tasks):
            manager = TaskManager(include_path=include)
    unknown = sorted(set(tasks) - set(manager.match_tasks(tasks)))
    if unknown:
        raise ConfigError(f"eval.harness_tasks: unknown lm-eval task(s) {', '.join(unknown)} (`lm_eval ls tasks` lists "
                          f"them; a task of your own: eval.harness_include=DIR){unloadable(include)}")
    return manager


def unloadable(include: str | None) -> str:
    """The first task file under `include` that lm-eval's index skips in silence (a YAML error, an
    `!include` of a missing file, no task name: it logs them at debug level only), as `; FILE
    does not load: ERROR`, or '': its tasks were "unknown" with no word of why."""
    if not include:
        return ""
    try:
        from lm_eval.tasks._index import TaskIndex
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:  # another lm-eval 0.4 layout: the message without it
        return ""
    for path in TaskIndex._iter_yaml_files(Path(os.path.expanduser(include))):
        try:  # as TaskIndex.build reads each file
            TaskIndex.process_cfg(load_yaml(path, resolve_func=False, recursive=True), path, {})
        except Exception as e:
            return f"; {path} does not load: {first_line(e) or type(e).__name__}"
    return ""


@contextlib.contextmanager
def quiet():
    """lm-eval's and `datasets`' logging and progress bars held back while the run's progress
    line is on the terminal (lm-eval's bars go to sys.stderr, which is set aside meanwhile); their
    errors still show, as exceptions."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "datasets")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


class HarnessEval:
    """The harness tasks of a run, evaluated on the parameters as the strategy stores them."""

    def __init__(self, run: Run, manager, harness_model: Any, codec):
        self.run, self.manager, self.lib = run, manager, harness_model
        self.codec = codec  # the run's tokenization (nljax.run.sampling.tokenization_of)
        self.reader = None  # made at the first evaluation (its forward compiles then)

    def evaluate(self, stored_params) -> dict:
        from lm_eval.evaluator import evaluate

        from nljax.run.scoring import StreamReader

        run, e = self.run, self.run.cfg.eval
        params = run.engine.strategy.gather_params(stored_params)
        if self.reader is None:
            self.reader = StreamReader(run.engine.model, params, run.mesh, run.cfg.train.seq_len, self.codec.end_id,
                                       run.cfg.train.batch_size, vocab=run.cfg.model.vocab_size)
        self.reader.params = params  # the same compiled forward, this evaluation's parameters
        lm = self.lib.NLJaxLM(self.lib.Reading(self.reader, self.codec, run.cfg.run.dir), progress=False)
        start = time.perf_counter()
        with quiet():
            tasks = self.manager.load(list(e.harness_tasks))
            for task in tasks["tasks"].values():  # as lm_eval.simple_evaluate prepares them
                if task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=FEWSHOT_SEED)
            results = evaluate(lm=lm, task_dict=tasks, limit=e.harness_limit or None, bootstrap_iters=0,
                               log_samples=False)
        return {**self.lib.results_of(results), "harness_time_s": time.perf_counter() - start}
