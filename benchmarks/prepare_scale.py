"""nljax.prepare at corpus scale: tokens/s per core and peak memory on a generated corpus of
Parquet shards, against the Hugging Face `tokenizers` batch encoder alone on the same text (the
most this step can do per core: everything else prepare does is reading, hashing and writing).

    python benchmarks/prepare_scale.py --gb 2 --workers 2 --dir /tmp/prepare_scale

1. writes DIR/corpus/*.parquet: FineWeb-like shards (documents of 200-8,000 characters of
   Zipf-distributed words, row groups of 1,000 documents), deterministic from --seed;
2. trains a byte-level BPE of --vocab tokens on the first 20 MB (the `tokenizers` trainer) and
   saves DIR/tokenizer.json;
3. runs `python -m nljax.prepare` on the shards as bytes and with the tokenizer.json
   (prepare.workers=--workers), each timed (wall, and the CPU seconds of the prepare and its
   workers: on a shared machine, tokens per CPU-second is the per-core rate), with the peak RSS
   of the whole process tree (sampled every 0.2 s from /proc: the prepare and its workers,
   summed) and of the prepare process alone;
4. times `Tokenizer.encode_batch` alone (wall and thread CPU time), on one thread, over the same documents read the same
   way (batches of 1,024; the first --encoder-chars of them, 2e8 by default, to keep the run
   short: a rate per core), the reading excluded: tokens/s per core;
5. prints one JSON line per measurement and a Markdown table; deletes DIR unless --keep.

Needs pyarrow and tokenizers (pip install -e '.[parquet,text]'). Writes only under --dir.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


def generate(root: Path, gb: float, seed: int) -> tuple[int, int]:
    """Parquet shards of ~256 MB of text; (documents, characters)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz", np.uint8)
    weights = 1 / np.arange(1, 27)
    lengths = rng.integers(1, 12, 60_000)
    words = np.array([bytes(rng.choice(letters, n, p=weights / weights.sum())).decode() for n in lengths])
    zipf = 1 / np.arange(1, len(words) + 1) ** 1.1
    zipf /= zipf.sum()
    root.mkdir(parents=True, exist_ok=True)
    target, total, docs, shard = int(gb * 1e9), 0, 0, 0
    while total < target:
        texts = []
        size = 0
        while size < 256e6 and total + size < target:
            ids = rng.choice(len(words), size=(2_000, 120), p=zipf)  # 2,000 documents of up to 120 words
            ends = rng.integers(30, 1_300, 2_000)
            for row, end in zip(ids, ends):
                text = " ".join(words[row[:min(end, 120)]].tolist())
                text = (text + ". ") * max(1, end // 120)  # longer documents repeat their words
                texts.append(text)
                size += len(text)
        pq.write_table(pa.table({"id": np.arange(docs, docs + len(texts)), "text": texts}),
                       root / f"shard-{shard:05d}.parquet", row_group_size=1_000)
        total, docs, shard = total + size, docs + len(texts), shard + 1
        print(f"generated shard {shard}: {total / 1e9:.2f} GB", file=sys.stderr, flush=True)
    return docs, total


def texts(root: Path, limit: int | None = None):
    """The shards' documents in lists of 1,024, as nljax reads them (documents whole)."""
    import pyarrow.parquet as pq

    seen = 0
    for path in sorted(root.glob("*.parquet")):
        f = pq.ParquetFile(path)
        for batch in f.iter_batches(batch_size=1024, columns=["text"]):
            out = batch.column(0).to_pylist()
            yield out
            seen += sum(map(len, out))
            if limit and seen >= limit:
                return


def train_tokenizer(root: Path, out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((t for batch in texts(root, 20_000_000) for t in batch), trainer)
    tok.save(str(out))


def tree_rss(pid: int, children: bool = True) -> int:
    """RSS in bytes of `pid` and (`children`) its descendants, from /proc."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(l for l in status.splitlines() if l.startswith("VmRSS:")).split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir() if children else ():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            pass
    return total


def run_prepare(args: list[str]) -> dict:
    """`python -m nljax.prepare *args`: wall time, peak RSS of the tree and of one process."""
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([sys.executable, "-m", "nljax.prepare", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    peak = main_peak = 0
    done = threading.Event()

    def sample():
        nonlocal peak, main_peak
        while not done.is_set():
            peak, main_peak = max(peak, tree_rss(proc.pid)), max(main_peak, tree_rss(proc.pid, False))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"nljax.prepare {' '.join(args)} failed ({proc.returncode})")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the prepare and its workers, waited for
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_tree_bytes": peak, "peak_rss_main_bytes": main_peak,
            "output": out.strip().splitlines()[0]}


ENCODER_ALONE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
from prepare_scale import texts
from pathlib import Path
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
tokens = chars = 0
spent = cpu = 0.0
for batch in texts(Path(sys.argv[1]), int(float(sys.argv[4])) or None):
    t, c = time.perf_counter(), time.thread_time()  # one thread: RAYON_NUM_THREADS=1, no parallelism
    enc = tok.encode_batch(batch, add_special_tokens=False)
    spent, cpu = spent + time.perf_counter() - t, cpu + time.thread_time() - c
    tokens += sum(len(e.ids) for e in enc)
    chars += sum(map(len, batch))
print(json.dumps({"tokens": tokens, "chars": chars, "encode_s": spent, "cpu_s": cpu}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="characters of text to generate, in 1e9")
    p.add_argument("--workers", type=int, default=2, help="prepare.workers for the tokenizer run")
    p.add_argument("--dir", default="/tmp/prepare_scale", help="where the corpus and outputs go (deleted after)")
    p.add_argument("--vocab", type=int, default=8192, help="the BPE's vocabulary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep --dir")
    p.add_argument("--encoder-chars", type=float, default=2e8,
                   help="characters of the corpus (its first shards) the encoder alone is timed on; 0: all")
    args = p.parse_args()
    root = Path(args.dir)
    corpus = root / "corpus"
    try:
        docs, chars = generate(corpus, args.gb, args.seed)
        train_tokenizer(corpus, root / "tokenizer.json", args.vocab)
        results = [{"what": "machine", "cpu": platform.processor() or platform.machine(),
                    "cores": len(os.sched_getaffinity(0)), "documents": docs, "characters": chars,
                    "date": time.strftime("%Y-%m-%d")}]
        env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        out = subprocess.run([sys.executable, "-c", ENCODER_ALONE, str(corpus), str(root / "tokenizer.json"),
                              str(Path(__file__).parent), str(args.encoder_chars)], capture_output=True, text=True, env=env, check=True)
        alone = json.loads(out.stdout)
        results.append({"what": "tokenizers encode_batch alone, 1 thread", "processes": 1, "tokens": alone["tokens"],
                        "tokens_per_s": alone["tokens"] / alone["encode_s"],
                        "tokens_per_s_per_core": alone["tokens"] / alone["encode_s"], "encode_s": alone["encode_s"],
                        "cpu_s": alone["cpu_s"], "tokens_per_cpu_s": alone["tokens"] / alone["cpu_s"]})
        print(json.dumps(results[-1]), flush=True)
        train = f"data.train={corpus}/*.parquet"
        for name, extra, workers in (("bytes", [], 1),
                                     ("tokenizer.json", [f"data.tokenizer={root / 'tokenizer.json'}",
                                                         "data.doc_end_token=<|endoftext|>"], args.workers)):
            r = run_prepare([train, *extra, f"prepare.workers={args.workers}", f"out={root / ('out-' + name)}"])
            m = json.loads((root / ("out-" + name) / "manifest.json").read_text())
            tokens = m["train"]["tokens"] + m["eval"]["tokens"]
            results.append({"what": f"nljax.prepare, {name}", "processes": workers, "tokens": tokens,
                            "tokens_per_s": tokens / r["wall_s"], "tokens_per_s_per_core": tokens / r["wall_s"] / workers,
                            "text_bytes_per_s": chars / r["wall_s"], "tokens_per_cpu_s": tokens / r["cpu_s"], **r})
            print(json.dumps(results[-1]), flush=True)
            shutil.rmtree(root / ("out-" + name))
        print("\n| what | processes | tokens | wall s | tokens/s | tokens/s per core | tokens per CPU-second | "
              "peak RSS (all processes) | peak RSS (prepare process) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in results[1:]:
            rss = lambda k: f"{r[k] / 2**20:,.0f} MiB" if k in r else "-"
            wall = r.get("wall_s", r.get("encode_s"))
            print(f"| {r['what']} | {r['processes']} | {r['tokens']:,} | {wall:,.1f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['tokens_per_s_per_core']:,.0f} | {r['tokens_per_cpu_s']:,.0f} | {rss('peak_rss_tree_bytes')} | {rss('peak_rss_main_bytes')} |")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
