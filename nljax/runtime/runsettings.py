"""Config sections of the run as a whole: `run`, `train`, `eval`, `distributed`, `throughput`.

Their readers (the trainer, the step loop, the tasks, the run directory, nljax/runtime/distributed.py,
the throughput report) all import `nljax.config`, which composes these sections: so the sections
sit in this leaf module, which imports no other part of nljax but the error type.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from nljax.errors import ConfigError, check_at_least

# The names `run.trackers` takes; nljax/run/trackers.py registers one tracker for each.
TrackerName = Literal["tensorboard", "wandb"]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"  # the run directory: config.yaml, metrics.jsonl, summary.json, plots, checkpoints
    overwrite: bool = False  # replace the files of an earlier run in run.dir
    quiet: bool = False  # print nothing but errors (on stderr), as --quiet
    # where scalars and samples go besides metrics.jsonl (nljax/run/trackers.py): tensorboard (event
    # files in run.dir), wandb (Weights & Biases); [] for none
    trackers: tuple[TrackerName, ...] = ("tensorboard",)
    # W&B: offline writes under run.dir/wandb with no network (`wandb sync` uploads it later);
    # WANDB_MODE, when set, wins. The run's name defaults to run.dir's last part.
    wandb_mode: Literal["offline", "online"] = "offline"
    wandb_project: str = "nljax"  # the W&B project of the run
    wandb_name: str = ""  # the W&B run's name ("": run.dir's last part)
    plots: bool = True  # loss.png and step_time.png in run.dir at the end
    # JAX's persistent compilation cache (nljax/runtime/compile_cache.py): auto (the user's cache
    # directory, ~/.cache/nljax/jax) | none | a directory
    compile_cache: str = "auto"

    def check(self) -> None:
        if not self.dir.strip():  # an unset shell variable: the run's files would land in the current directory
            raise ConfigError("run.dir must not be empty")
        if len(set(self.trackers)) != len(self.trackers):
            raise ConfigError(f"run.trackers names a tracker twice: {list(self.trackers)}")
        if not self.wandb_project:
            raise ConfigError("run.wandb_project must not be empty")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200  # optimizer steps of the run (the learning-rate schedule spans them)
    batch_size: int = 16  # global rows per optimizer step
    seq_len: int = 128  # tokens per row of a step: the window the model reads, its memory carried between windows
    accum_steps: int = 1  # micro-batches per optimizer step, accumulated on each device
    # stop (one line, exit 2) when this many steps in a row were skipped: nothing is training; 0: off
    max_skipped: int = 20
    # stop early (MaxText's target_eval_loss) once an evaluation during training (every eval.every
    # steps) has eval_loss at or below this: the fresh-memory loss on the main held-out text
    # (data.eval, or the data.eval_fraction split), not the streaming one nor a data.eval_sets
    # set's. The run ends there as at train.steps (exit 0; its checkpoint saved, unless
    # checkpoint.every=0); a --resume evaluates its checkpoint first and, at or below the
    # target, stops there again without training. Text models; 0: off
    target_eval_loss: float = 0.0
    log_every: int = 10  # steps between log lines when the output is not a terminal (else a progress bar)
    # dispatch each step before reading the one before's loss where no hook needs that step's state
    # (nljax/run/loop.py): the host's work between steps overlaps the device's; false: each step's
    # loss is read before the next is dispatched (an error on the device is then raised at its step);
    # auto: on a GPU or TPU, not on a CPU (there the device is the host's own cores, which the
    # overlap only shares: 1.5% slower on the default job, 2026-11-30)
    dispatch_ahead: bool | Literal["auto"] = "auto"
    profile_steps: int = 0  # record a jax.profiler trace of this many steps into run.dir/profile
    profile_start: int = 10  # first profiled step (after compilation); below train.steps, or the run is refused
    # every N steps print a short text sample from the training state and send it to the trackers
    # (nljax/run/samples.py; text models only); 0: off
    sample_every: int = 0
    sample_prompt: str = ""  # text the sample continues ("": from a document start)
    sample_tokens: int = 64  # tokens (bytes, or the tokenizer's) sampled after the prompt; fewer at a document end

    RANGES: ClassVar[dict] = {"target_eval_loss": (0, None, True, None)}

    def check(self) -> None:
        check_at_least("train", self, steps=0, batch_size=1, seq_len=1, accum_steps=1)
        if self.steps >= 2**31:  # the step counter is an int32 on the devices
            raise ConfigError(f"train.steps must be < 2^31, got {self.steps}")
        if self.max_skipped < 0:
            raise ConfigError(f"train.max_skipped must be >= 0, got {self.max_skipped}")
        check_at_least("train", self, log_every=1, profile_steps=0, profile_start=0)
        if self.sample_every < 0 or self.sample_tokens < 1:
            raise ConfigError(f"train.sample_every must be >= 0 (0: off) and train.sample_tokens >= 1, got "
                              f"{self.sample_every} and {self.sample_tokens}")
        try:  # bytes that are not UTF-8 reach Python's argv as lone surrogates
            self.sample_prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"train.sample_prompt is not UTF-8 text (at character {e.start})") from None
        if self.sample_tokens > MAX_SAMPLE_TOKENS:  # one compiled step per token: bounded before any work
            raise ConfigError(f"train.sample_tokens must be <= {MAX_SAMPLE_TOKENS:,}, got {self.sample_tokens:,}")


MAX_SAMPLE_TOKENS = 65_536  # train.sample_tokens: a sample is printed, not a corpus
MAX_REPS = 1_000  # throughput.reps: a median of a thousand timings is as good as of more


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 100  # steps between evaluations (and one at the end)
    # fresh-memory evaluation: batches of train.batch_size independent windows (0: all); at most
    # the held-out text's windows, each read once (eval_tokens in metrics.jsonl says how many tokens)
    batches: int = 4
    # streaming evaluation: train.batch_size rows each read this many consecutive held-out
    # windows with the memory carried between them (0: off; data.source=recall needs it)
    stream_steps: int = 4
    # lm-evaluation-harness tasks run at every evaluation on the current parameters and logged as
    # harness_<task>_<metric> (pip install 'nljax[lm-eval]'; docs/guides/evaluation.md)
    harness_tasks: tuple[str, ...] = ()
    harness_limit: int = 100  # examples per harness task at each evaluation (0: all; lm-eval's --limit)
    harness_include: str = ""  # a directory of your own lm-eval task YAML files (lm-eval's --include_path)

    def check(self) -> None:
        check_at_least("eval", self, every=0, batches=0, stream_steps=0)  # the key named, with its value
        if self.harness_limit < 0:
            raise ConfigError(f"eval.harness_limit must be >= 0 (0: every example), got {self.harness_limit}")
        if len(set(self.harness_tasks)) != len(self.harness_tasks):
            raise ConfigError(f"eval.harness_tasks names a task twice: {list(self.harness_tasks)}")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (nljax/runtime/distributed.py)."""

    timeout_s: int = 60  # a dead process is noticed, and the others stopped, within this long
    check_every: int = 100  # loop iterations between lockstep checks of the step and Pulse; 0: off

    def check(self) -> None:
        check_at_least("distributed", self, timeout_s=1, check_every=0)  # the key named, with its value


@dataclasses.dataclass(frozen=True)
class ThroughputConfig:
    # timed rounds over every pulse pattern at the end of a run (medians reported): this many, more
    # when rounds are short (as many as fill one second, up to 200), fewer beyond max_fraction;
    # 0: no timing (it compiles every pattern the loop did not): summary.json has no throughput table
    reps: int = 5
    # the end-of-run timing stops short of throughput.reps rounds where they would take more than
    # this fraction of the training loop's time (one round at least: every pattern gets a time),
    # so it adds at most ~10% to a run: a report, not the run's work
    max_fraction: float = 0.1
    # also time each pattern without its collectives (compute vs communication): compiles a
    # one-device program per pattern, minutes on a CPU, so off by default; `nljax.bench --profile N`
    # shows the collectives' device time instead
    split: bool = False
    # per-device peak for MFU (the table's and each step's `mfu` in metrics.jsonl); 0: from the
    # device kind when known (none on a CPU: no MFU)
    peak_tflops: float = 0.0

    def check(self) -> None:
        check_at_least("throughput", self, reps=0, peak_tflops=0)
        if self.max_fraction <= 0:
            raise ConfigError(f"throughput.max_fraction must be > 0, got {self.max_fraction}")
        if self.reps > MAX_REPS:  # nljax.bench times every rep whatever max_fraction says
            raise ConfigError(f"throughput.reps must be <= {MAX_REPS:,}, got {self.reps:,}")
