"""Shared test plumbing: the tiny configs, a run on the first n devices and `train` to step it,
checkpoints written as a run writes them (and damaged), and command lines run in subprocesses."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import yaml

from nljax import config
from nljax.checkpoint import storage
from nljax.engine.conductor import pulse
from nljax.engine.state import TrainState
from nljax.parallel.hostdev import mean_loss
from nljax.run.core import Run

ROOT = Path(__file__).resolve().parent.parent  # the checkout: its nljax is the one under test
# A jit's compiler_options for a test that claims two programs give the same bits: XLA:CPU's
# default emitters, where conftest chose the faster-compiling older ones (jaxlib 0.10).
EXACT = ({"xla_cpu_use_fusion_emitters": True}
         if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "").split() else {})
FAST_EMITTERS = "--xla_cpu_use_fusion_emitters=false"  # conftest's flag (jaxlib 0.10)

# ---------------------------------------------------------------------------------------------
# Tiny configs (overrides; later ones win, so a test adds its own after these)

# A model small enough that a step variant compiles in seconds on a 2-core CPU.
TINY = [
    "model.name=cms_mlp",
    "model.dim=16",
    "model.depth=1",
    "model.hidden_mult=2",
    "train.batch_size=8",
    "train.seq_len=8",
    "optim.lr=0.01",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
]

# TINY with attention and a neural memory (per-row state written across steps) and two CMS levels.
TINY_NL = ["model.name=nl_lm", "model.heads=2", "model.nl_lm.window=8", "model.nl_lm.memory_layers=[0]", "model.nl_lm.memory_heads=2",
           "model.nl_lm.memory_dim=8", "model.nl_lm.memory_hidden=8", "model.nl_lm.memory_chunk=4", "cms.periods=[1,2]"]

# TINY_NL two blocks deep with the memory in the second (block1) and a 4-token window.
TINY_NL_DEEP = [*TINY_NL, "model.depth=2", "model.nl_lm.memory_layers=[1]", "model.nl_lm.window=4",
                "model.nl_lm.memory_dim=4"]

# A tiny cms_mlp for command-line runs (`cli`): three CMS levels, the default optimizer and
# learning rate.
SMALL = ["model.name=cms_mlp", "model.dim=16", "model.depth=1", "train.batch_size=8", "train.seq_len=16",
         "cms.periods=[1,2,4]", "eval.batches=1", "optim.warmup_steps=0"]

# The end-of-run report cut to one timing round, no plots, no TensorBoard: for command-line runs
# that test something else.
QUICK = ["throughput.reps=1", "throughput.split=false", "run.plots=false", "run.trackers=[]"]


# ---------------------------------------------------------------------------------------------
# A run and its steps


@dataclasses.dataclass(eq=False)
class Setup:
    """A run and the state the tests step on from it (a `Run` keeps no state, its steps donate
    it); the run's fields and methods read through."""

    run: Run
    state: TrainState

    @classmethod
    def create(cls, cfg: config.Config, devices=None) -> "Setup":
        run = Run.create(cfg, devices)
        return cls(run, run.init_state())

    def __getattr__(self, name):
        if name == "run":  # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.run, name)


def make(overrides=(), inter=1, intra=1, model=1) -> Setup:
    """TINY with `overrides` on the first inter x intra x model devices."""
    cfg = config.load(None, [*TINY, *overrides, f"mesh.inter={inter}", f"mesh.intra={intra}", f"mesh.model={model}"])
    return Setup.create(cfg, devices=jax.devices()[: inter * intra * model])


def train(setup: Setup, steps, *, state: TrainState | None = None, batch=None, active=None,
          metrics: list | None = None) -> tuple[np.ndarray, TrainState]:
    """Train `steps` (a count from step 0, or the steps themselves: `range(2, 5)`) from `state`,
    by default `setup.state`; returns (each step's mean loss, the final state). Each step donates
    the state it is given, so training from `setup.state` leaves the final state there.

    `batch(step)` gives the batches (default `setup.batch`); `active`, the levels that train at
    every step (default: the Conductor's pulse of each step); `metrics`, a list, receives each
    step's metrics as the step returned them."""
    own = state is None
    state = setup.state if own else state
    losses = []
    for s in range(steps) if isinstance(steps, int) else steps:
        levels = pulse(s, setup.cfg.cms.periods).active if active is None else active
        state, m, _ = setup.cache.train(levels, state, setup.batch(s) if batch is None else batch(s))
        losses.append(mean_loss(m))
        if metrics is not None:
            metrics.append(m)
    if own:
        setup.state = state
    return np.array(losses), state


def leaf_pairs(a, b):
    """The leaves of `a` and `b` side by side, once the two are shown to be trees of one structure
    with at least one leaf: a zip of their leaf lists would stop silently at the shorter, so a
    tree missing its last leaves, or an empty one, would go uncompared."""
    sa, sb = jax.tree.structure(a), jax.tree.structure(b)
    assert sa == sb, f"the trees differ in structure:\n{sa}\n{sb}"
    assert sa.num_leaves > 0, "no leaves to compare"
    return zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in leaf_pairs(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def assert_trees_equal(a, b):
    """Bit for bit, leaf by leaf (`leaf_pairs`)."""
    for x, y in leaf_pairs(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def replicas(x: jax.Array) -> list[np.ndarray]:
    """Each device's own copy of a replicated array."""
    return [np.asarray(s.data) for s in x.addressable_shards]


# ---------------------------------------------------------------------------------------------
# Checkpoints


def saved_run(run_dir: Path, overrides, inter, intra, steps=2, model=1):
    """A run directory as nljax.train leaves it (config.yaml, a checkpoint after `steps` steps)."""
    setup = make([*overrides, f"run.dir={run_dir}"], inter, intra, model)
    _, state = train(setup, steps)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(setup.cfg), sort_keys=False))
    save(setup, state, steps)
    return setup, state


def save(setup: Setup, state: TrainState, step: int) -> None:
    """A checkpoint of `state` after `step` steps in the run's checkpoint.dir, on disk on return."""
    m = storage.writer(setup.cfg)
    storage.save(m, setup.engine, step, state)
    m.wait_until_finished()
    m.close()


def tree_hash(root: Path) -> str:
    """A digest of every path and file content under `root`: equal before and after means nothing
    on disk changed."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def data_files(step_dir: Path) -> list[Path]:
    """Every array data file of a checkpoint's step directory (at least one)."""
    # every data file: an OCDBT store may keep data that no array reads any more, whose damage
    # rightly goes unnoticed
    files = [f for f in (step_dir / "state").rglob("d/*") if f.is_file()]
    assert files
    return files


def truncate(step_dir: Path) -> None:
    """Damage a checkpoint: every array data file cut to half its length."""
    for f in data_files(step_dir):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def lock(folder: Path, monkeypatch) -> None:
    """`folder` made unwritable to this process (mode 0o555; the caller makes it 0o755 again).
    Root writes into it whatever its mode, and `os.access`, which the commands ask before they
    write (`nljax.writable`), says so: as root, `os.access` answers for `folder` as it does for
    any other user (or for a read-only mount), so that a test of the refusal runs here too (it was
    skipped, and the refusal of every command went untested where the suite runs as root)."""
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):
        access = os.access

        def as_another_user(path, mode, *args, **kwargs):
            return not (mode & os.W_OK and Path(path) == folder) and access(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", as_another_user)


# ---------------------------------------------------------------------------------------------
# Command lines in subprocesses


def default_emitters(env: dict[str, str]) -> dict[str, str]:
    """`env` without conftest's faster-compiling emitters: for a command whose check reads what a
    user's compile gives (how long it takes: with the older emitters a compile is too quick for a
    cache's saving to show; whether XLA counts a step's FLOPs: with them XLA:CPU leaves a while
    loop in the bench's fully unrolled step, whose FLOPs it then does not count)."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f != FAST_EMITTERS]
    return {**{k: v for k, v in env.items() if k != "XLA_FLAGS"}, **({"XLA_FLAGS": " ".join(flags)} if flags else {})}


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a command run in a subprocess: this one with `extra` on top, less what
    would make it another run than the one the test asks for. The suite's device count goes (the
    command sets its own, `--cpu-devices`); its other XLA flags stay (conftest: the compile-time
    flags), and so does its platform (conftest: JAX_PLATFORMS=cpu), so that a command without
    `--cpu-devices` runs on the CPU too (JAX's CUDA plugin, on a machine without a GPU, then
    skips the checks whose failure it logs). A launcher's or a cluster's process
    variables go (NLJAX_*, SLURM_*, OMPI_*: the command would take itself for one process of
    several). This checkout comes first on the path, so the command runs the nljax under test."""
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and not k.startswith(("NLJAX_", "SLURM_", "OMPI_"))}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_python(*argv: str, check: bool = True, env: dict[str, str] | None = None, timeout: float = 600,
               **kwargs) -> subprocess.CompletedProcess:
    """`python *argv` in a subprocess with `subprocess_env(**env)`, its output captured as text.
    `check`: a non-zero exit fails the test, showing both streams. `kwargs` go to
    `subprocess.run` (`cwd`)."""
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=subprocess_env(**(env or {})),
                       timeout=timeout, **kwargs)
    if check and p.returncode:
        raise AssertionError(f"{list(argv)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def python_block(path: Path, marker: str | None = None) -> str:
    """The first ```python block of `path` (after the line `marker`, when given): a doc's
    snippet, for a test that runs the doc's own text."""
    text = path.read_text()
    if marker is not None:
        assert marker in text.splitlines(), f"{path} has no line {marker}"
        text = text.split(marker, 1)[1]
    m = re.search(r"```python\n(.*?)```", text, re.S)
    assert m, f"no python block in {path}"
    return m.group(1)


def cli(module: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """`python -m module *args` (e.g. `cli("nljax.train", "--cpu-devices", "2", *SMALL)`); the
    keyword arguments of `run_python`."""
    return run_python("-m", module, *args, **kwargs)


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# Runs nljax.train with the file-size limit lowered (as a full disk would stop writes) once
# checkpoint 4 is complete and step 5 is logged: the save of step 8 fails inside TensorStore.
# argv: checkpoint dir ("-": do not wait for one), the limit in bytes, then nljax.train's. Under
# nljax.launch with FULL_ON_PROCESS=<i> set, only process i's disk fills.
FULL = r"""
import os, resource, signal, sys, time
from pathlib import Path
ckdir, limit = Path(sys.argv[1]), int(sys.argv[2])
sys.argv = ["nljax.train", *sys.argv[3:]]
from nljax.runtime import rundir
log = rundir.RunDir.log
def limiting_log(self, record):
    log(self, record)
    here = os.environ.get("FULL_ON_PROCESS") in (None, os.environ.get("NLJAX_PROCESS_ID"))
    if record["step"] == 5 and here:
        t = time.time()
        while str(ckdir) != "-" and not (ckdir / "4").is_dir() and time.time() - t < 60:
            time.sleep(0.05)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
rundir.RunDir.log = limiting_log
from nljax.train import main
sys.exit(main())
"""


def bpe_corpus(root: Path, line: str) -> list[str]:
    """24 small documents under root/corpus (`line`, with {i} and {sq}, said 12 times each) and a
    300-token byte-level BPE trained on them (root/tok.json, `<eos>` its document end): the
    overrides that train on them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = root / "corpus"
    corpus.mkdir()
    docs = [line.format(i=i, sq=i * i) * 12 for i in range(24)]
    for i, d in enumerate(docs):
        (corpus / f"d{i}.txt").write_text(d)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tok.json"))
    return ["data.source=files", f"data.train={corpus}/*.txt", f"data.tokenizer={root / 'tok.json'}",
            "data.doc_end_token=<eos>", "eval.stream_steps=0", "model.vocab_size=300"]
