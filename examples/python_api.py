"""A trained model from Python (`nljax.load`): train a small model for a few steps with the
`python -m nljax.train` command's entry, then load its run directory and its export, turn text
into tokens and back, sample text, and read the logits with the memory carried. Runs from any
directory; writes only into a temporary directory.

    python examples/python_api.py               # under a minute on a 2-core CPU
"""

import sys
import tempfile
from pathlib import Path

import jax

import nljax
from nljax import export as export_command
from nljax import train as train_command

with tempfile.TemporaryDirectory() as tmp:
    run_dir = Path(tmp) / "run"
    small = ["model.dim=32", "model.depth=1", "model.heads=2", "train.seq_len=32", "train.batch_size=4",
             "model.nl_lm.memory_chunk=8", "cms.periods=[1,2]", "eval.stream_steps=0", "eval.batches=1",
             "throughput.split=false", "throughput.reps=1", "run.plots=false", "run.quiet=true"]
    if train_command.main(["--config", "nl_default", f"run.dir={run_dir}", "train.steps=20", *small]) != 0:
        sys.exit("training failed")
    if export_command.main([f"run.dir={run_dir}"]) != 0:
        sys.exit("the export failed")

    lm = nljax.load(run_dir)  # the newest checkpoint of the run directory, on one device
    print(f"{lm.config.model.name} after {lm.step} steps, windows of {lm.seq_len} tokens")
    ids = lm.encode("def f(x):\n    return x")  # the run's tokenizer: here UTF-8 bytes
    print("tokens:", ids[:12], "... ->", repr(lm.decode(ids)))

    print("sampled:", repr(lm.generate("def ", max_new_tokens=60, temperature=0.8, top_k=40, seed=0)))

    # the logits of a text longer than a window: read window by window, the memory carried
    logits, memory = lm.logits([ids * 3])
    print("logits", logits.shape, "memory leaves", [x.shape for x in jax.tree.leaves(memory)])
    # reset: the per-row memory reset flag. True starts the row from a fresh memory, False continues
    again, _ = lm.logits([ids[: lm.seq_len]], memory, reset=[False])
    fresh, _ = lm.logits([ids[: lm.seq_len]], memory, reset=[True])
    print("what the memory adds to the next window's logits (max abs):", float(abs(again - fresh).max()))

    exported = nljax.load(run_dir / "export")  # the export: no checkpoints, no data needed
    same = exported.generate("def ", max_new_tokens=60, temperature=0.8, top_k=40, seed=0)
    print("the export samples the same text:", same == lm.generate("def ", max_new_tokens=60, temperature=0.8,
                                                                  top_k=40, seed=0))
