"""The Python API in a loop, as a notebook uses it: `nljax.train.main` N times in one process,
then `generate` and `logits` on one loaded model, then `nljax.load` again and again; after each,
RSS, file descriptors, threads, `jax.live_arrays()` and the Python objects the collector tracks
(docs/benchmarks/2026-12-02-long-runs.md).

    python benchmarks/api_loop.py --runs 10 --loads 8 --out runs/api
    python benchmarks/api_loop.py --runs 8 --loads 0 --corpora 'corpora/c*' --out runs/api

With `--corpora`, run i trains 20 steps on the text files of the i-th folder the glob names
(data.source=files, tokenized into memory), and each line says too how many text tasks are
alive and the training tokens they hold.
"""

from __future__ import annotations

import argparse
import gc
import glob
import time

import psutil

import nljax
import nljax.train

TINY = ["model.dim=32", "model.depth=1", "model.heads=2", "model.nl_lm.window=16", "model.nl_lm.memory_heads=2",
        "model.nl_lm.memory_dim=8", "model.nl_lm.memory_hidden=16", "model.nl_lm.memory_chunk=8",
        "train.seq_len=32", "train.batch_size=4", "train.steps=40", "eval.every=20", "eval.batches=1",
        "eval.stream_steps=1", "checkpoint.every=20", "train.sample_every=20", "train.sample_tokens=8",
        "throughput.reps=1", "run.quiet=true", "run.trackers=[tensorboard]"]


def snap(tag: str) -> None:
    import jax

    gc.collect()
    p = psutil.Process()
    objects = gc.get_objects()
    tasks = [o for o in objects if type(o).__name__ == "TextTask"]
    tokens = {id(t.data.train): t.data.train.nbytes for t in tasks if t.data.train is not None}
    print(f"{tag:>16}  rss {p.memory_info().rss / 2**20:7.1f} MB  fds {p.num_fds():3d}  threads "
          f"{p.num_threads():3d}  live_arrays {len(jax.live_arrays()):5d}  objects {len(objects):8d}  "
          f"text tasks {len(tasks)} ({sum(tokens.values()) / 2**20:.1f} MB of training tokens)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--loads", type=int, default=8)
    ap.add_argument("--out", default="runs/api")
    ap.add_argument("--corpora", default=None, help="a glob of folders of .txt files: one a run")
    a = ap.parse_args()
    corpora = sorted(glob.glob(a.corpora)) if a.corpora else []
    for i in range(a.runs):
        t = time.perf_counter()
        data = [] if not corpora else ["data.source=files", f"data.train={corpora[i % len(corpora)]}/*.txt",
                                        "data.eval_fraction=0.2", "train.steps=20", "train.sample_every=0"]
        assert nljax.train.main([*TINY, *data, f"run.dir={a.out}/r{i}", "run.overwrite=true"]) == 0
        snap(f"train {i} {time.perf_counter() - t:4.1f}s")
    if corpora:
        return
    lm = nljax.load(f"{a.out}/r0")
    for i in range(8):
        for _ in range(10):
            lm.generate("def ", max_new_tokens=16, seed=i)
            lm.logits([lm.encode("def f(x): return x")])
        snap(f"generate {10 * (i + 1)}")
    for i in range(a.loads):
        nljax.load(f"{a.out}/r0").generate("a", max_new_tokens=4, seed=0)
        snap(f"load {i + 1}")


if __name__ == "__main__":
    main()
