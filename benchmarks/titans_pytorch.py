"""Side by side with titans-pytorch: its demo model against nljax's packaged titans_demo config.

    pip install -e '.[bench]'     # torch and titans-pytorch; nothing in nljax imports them
    python benchmarks/titans_pytorch.py [--batch 4] [--seq 512] [--rounds 2] [--warmup 1]
                                        [--device cpu|cuda] [--dtype fp32|bf16] [--threads 1]
                                        [--out FILE.json] [nljax key=value ...]

One process, one device, the same batch x sequence. Rounds are interleaved (nljax steps, then a
titans-pytorch step, ...) so that a drift of clock or load hits both alike; medians reported.

- titans-pytorch: `MemoryAsContextTransformer` exactly as its `train_mac.py` builds it (0.5.5;
  `use_flex_attn` and `use_accelerated_scan` off, as the anchor was measured), AdamW; one step is
  forward + backward + optimizer on one batch (train_mac.py accumulates 4 such batches per step;
  a step here is one of them). bf16: `torch.autocast`.
- nljax: `nljax.run.core.Run` on a 1-device mesh with the config (default the packaged titans_demo),
  its compiled step variants for level 0 alone (448 of every 512 steps) and all levels firing,
  the cycle mean estimated as 7/8 level-0 + 1/8 the slower of the two (conservative: the three
  rarer patterns are charged as the slower pattern measured), each step waited for. Also the same
  cycle run by the training loop (`nljax (loop)`: 8 steps, all levels at the first, through
  `nljax.run.loop.training_steps`, which on a GPU dispatches each step before the one before is
  read: `train.dispatch_ahead`), what training gets. The script only uses the engine's public
  pieces, so it does not depend on the model's internals.

CPU: one thread each by default (`--threads 1`: torch.set_num_threads, XLA's single-threaded
Eigen, the process pinned to one core), as the anchor (39.8 s per step, 51 tokens/s) was measured.
Parameter counts and 6 N (N: parameters except token embeddings) put the two models' sizes side
by side: the outer-loop FLOP/s each reaches is tokens/s x 6 N.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ANCHOR = "titans-pytorch 0.5.5, 1 CPU core, fp32, 4 x 512: 39.8 s/step, 51 tokens/s"
CYCLE = 8  # steps of the loop's call: one all-levels step and 7 level-0 steps, as the cycle mean weighs them
LOOP = f"loop x{CYCLE}"  # nljax's call of CYCLE steps through the training loop


def pin_threads(args) -> None:
    """Before torch or jax start: one core, one thread (CPU). On a GPU, JAX must not take 75% of
    its memory up front (its default): titans-pytorch needs ~16 GB of it at batch 4 in bf16."""
    if args.device != "cpu":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        return
    if args.threads < 1:
        return
    if args.threads == 1:
        # (not `intra_op_parallelism_threads=1`, often quoted with it: not an XLA flag, it
        # ends XLA's parsing of the flags, and any written after it are silently ignored)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if hasattr(os, "sched_setaffinity"):  # what `taskset` does, from inside
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, set(cores[-args.threads:]))


def titans_model():
    from titans_pytorch import MemoryAsContextTransformer, MemoryMLP

    return MemoryAsContextTransformer(
        num_tokens=256, dim=384, depth=8, segment_len=32,
        num_persist_mem_tokens=4, num_longterm_mem_tokens=4,
        neural_memory_layers=(2, 4, 6), neural_memory_segment_len=4, neural_memory_batch_size=128,
        neural_mem_gate_attn_output=False, neural_mem_weight_residual=True,
        neural_memory_qkv_receives_diff_views=True, use_flex_attn=False, sliding_window_attn=True,
        neural_memory_model=MemoryMLP(dim=64, depth=2),
        neural_memory_kwargs=dict(
            dim_head=64, heads=4, attn_pool_chunks=True, qk_rmsnorm=True, momentum=True, momentum_order=1,
            default_step_transform_max_lr=1e-1, use_accelerated_scan=False, per_parameter_lr_modulation=True,
            spectral_norm_surprises=True,
        ),
    )


def torch_side(args):
    """(a call that runs one titans-pytorch train step, parameters, non-embedding parameters)."""
    import torch

    if args.device == "cpu" and args.threads >= 1:
        torch.set_num_threads(args.threads)
    dev = "cuda" if args.device in ("cuda", "gpu") else "cpu"
    torch.manual_seed(0)
    model = titans_model().to(dev)
    for p in model.parameters():
        # The memory model's initial weights are one tensor expanded over the heads (stride 0);
        # AdamW's in-place update refuses to write to such a view. A contiguous copy has the
        # same shape, values and cost (and numel, which is what counts the 19.8M parameters).
        if 0 in p.stride():
            p.data = p.data.clone(memory_format=torch.contiguous_format)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    data = torch.randint(0, 256, (args.batch, args.seq + 1), device=dev)
    n = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters())

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = model(data, return_loss=True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())

    return step, n, n - emb


def nljax_side(args):
    """(pattern name -> a call that runs one nljax step, {parameters, non-embedding parameters,
    the forms the model's `auto` settings took here}, the dtype it computes in)."""
    import jax

    from nljax import config
    from nljax.bench import loop_steps, unevaluated
    from nljax.engine.conductor import Conductor, pattern_name
    from nljax.measure import flops
    from nljax.models.registry import forms_of
    from nljax.run.core import Run

    overrides = [f"train.batch_size={args.batch}", f"train.seq_len={args.seq}", "mesh.inter=1", "mesh.intra=1",
                 *args.overrides]
    dtype = "float32"
    if args.dtype == "bf16":
        try:  # model.dtype arrives with mixed precision (issue 17, item 2); until then float32
            config.load(args.config, [*overrides, "model.dtype=bfloat16"])
            overrides.append("model.dtype=bfloat16")
            dtype = "bfloat16"
        except config.ConfigError as e:
            print(f"note: nljax runs float32 ({e})")
    cfg = config.load(args.config, overrides)
    setup = Run.create(unevaluated(cfg), devices=jax.devices()[:1])
    state = setup.init_state()
    batch = setup.batch(0)
    n_levels = len(cfg.cms.periods)
    chain = {"state": state}

    def runner(active):
        fn = setup.cache.train_fn(active, chain["state"], batch)  # compiled here, not in the timing

        def step():
            chain["state"], metrics = fn(chain["state"], batch)
            jax.block_until_ready((chain["state"], metrics))

        return step

    level0, every = tuple(l == 0 for l in range(n_levels)), (True,) * n_levels
    steps = {pattern_name(a): runner(a) for a in dict.fromkeys((level0, every))}
    chain["step"] = 0  # the loop's next step
    # both patterns compiled above (`runner`): no step of the loop waits as for a compilation
    warm = {setup.cache.variant(a, batch) for a in (level0, every)}

    def loop():
        """CYCLE steps as the trainer runs them (nljax.run.loop.training_steps: train.dispatch_ahead
        as the config says, `auto` on a GPU), all levels at the first and level 0 at the others: a
        Conductor of periods (1, CYCLE, CYCLE, ...) fires just the two compiled patterns above."""
        start = chain["step"]
        conductor = Conductor((1,) + (CYCLE,) * (n_levels - 1), start)
        chain["state"] = loop_steps(setup, chain["state"], conductor, CYCLE, warm)
        chain["step"] = start + CYCLE

    steps[LOOP] = loop
    n, n_mat = flops.matmul_params(setup.engine.param_shapes)
    return steps, {"params": n, "nonembedding_params": n_mat, "forms": forms_of(setup.engine.model)}, dtype


def interleaved(calls: dict, warmup: int, rounds: int, say, settle: bool = True, switch=lambda: None) -> dict:
    """Median seconds per call, over `rounds` rounds of every call in turn after `warmup` rounds.
    `settle`: where the library changes (nljax -> titans-pytorch and back), one untimed call of the
    next first. Measured: the first nljax step after a titans-pytorch step took 1.4x its steady
    time (2.7 vs 1.9 s at 2 x 512 on one core; the other library's buffers leave the caches and
    the allocator cold), which charged the pattern timed first with the switch. `switch()` runs
    where the library changes, before that call."""
    times = {k: [] for k in calls}
    previous = None
    for i in range(warmup + rounds):
        for k, call in calls.items():
            library = k.split()[0]
            if settle and previous is not None and library != previous:
                switch()
                t0 = time.perf_counter()
                call()
                say(f"settle: {k} {time.perf_counter() - t0:.3f} s (untimed)")
            previous = library
            t0 = time.perf_counter()
            call()
            dt = time.perf_counter() - t0
            say(f"{'warm-up' if i < warmup else 'round'} {i - warmup if i >= warmup else i}: {k} {dt:.3f} s")
            if i >= warmup:
                times[k].append(dt)
    return {k: statistics.median(ts) for k, ts in times.items()}


def report(args, med: dict, sizes: dict, nl_dtype: str) -> dict:
    from nljax.measure import hostmem

    tokens = args.batch * args.seq
    r = {"batch": args.batch, "seq": args.seq, "device": args.device, "dtype": args.dtype, "nljax_dtype": nl_dtype,
         "threads": args.threads, "config": args.config, "overrides": list(args.overrides), "anchor": ANCHOR,
         "malloc": hostmem.settings()}
    names = [k for k in med if k.startswith("nljax ") and k != f"nljax {LOOP}"]
    if names:
        nl_l0 = med[names[0]]
        worst = max(med[k] for k in names)
        # the cycle mean: 7/8 level-0 steps, the rarer patterns charged as the slower one measured
        nl_mean = (7 * nl_l0 + worst) / 8
        r["nljax"] = {"step_s": {k[6:]: med[k] for k in names}, "step_s_cycle_mean": nl_mean,
                      "tokens_per_s": tokens / nl_mean, "tokens_per_s_worst": tokens / worst, **sizes["nljax"]}
        if f"nljax {LOOP}" in med:  # the same cycle run by the training loop: what training gets
            loop_s = med[f"nljax {LOOP}"] / CYCLE
            r["nljax"].update(step_s_in_loop=loop_s, tokens_per_s_in_loop=tokens / loop_s)
    if "titans-pytorch" in med:
        t = med["titans-pytorch"]
        r["titans_pytorch"] = {"step_s": t, "tokens_per_s": tokens / t, **sizes["titans_pytorch"]}
    if names and "titans-pytorch" in med:
        n_nl, n_t = sizes["nljax"]["nonembedding_params"], sizes["titans_pytorch"]["nonembedding_params"]
        r["ratio_tokens_per_s"] = r["nljax"]["tokens_per_s"] / r["titans_pytorch"]["tokens_per_s"]
        r["ratio_tokens_per_s_worst"] = r["nljax"]["tokens_per_s_worst"] / r["titans_pytorch"]["tokens_per_s"]
        if "tokens_per_s_in_loop" in r["nljax"]:
            r["ratio_tokens_per_s_in_loop"] = r["nljax"]["tokens_per_s_in_loop"] / r["titans_pytorch"]["tokens_per_s"]
        # tokens/s x 6N is the outer-loop FLOP/s each reaches: the ratio of work done per second
        r["ratio_outer_flops_per_s"] = r["ratio_tokens_per_s"] * n_nl / n_t
        # tokens/s per outer-loop FLOP per token (tokens/s / 6N), as the issue words it
        r["ratio_tokens_per_s_per_outer_flop"] = r["ratio_tokens_per_s"] * n_t / n_nl
    return r


def format_report(r: dict) -> str:
    lines = [f"{r['batch']} x {r['seq']} tokens per step, {r['device']}, {r['dtype']} (nljax {r['nljax_dtype']}), "
             f"threads {r['threads']}",
             f"{'':<16}{'params':>14}{'6N/token':>14}{'s/step':>10}{'tokens/s':>12}"]
    row = lambda name, d, s, tps: (f"{name:<16}{d['params']:>14,}{6 * d['nonembedding_params']:>14,}{s:>10.3f}"
                                   f"{tps:>12,.1f}")
    if "nljax" in r:
        nl = r["nljax"]
        lines.append(row("nljax (mean)", nl, nl["step_s_cycle_mean"], nl["tokens_per_s"]))
        for k, s in nl["step_s"].items():
            lines.append(f"  {k:<14}{'':>28}{s:>10.3f}{r['batch'] * r['seq'] / s:>12,.1f}")
        if "step_s_in_loop" in nl:
            lines.append(row("nljax (loop)", nl, nl["step_s_in_loop"], nl["tokens_per_s_in_loop"]))
    if "titans_pytorch" in r:
        t = r["titans_pytorch"]
        lines.append(row("titans-pytorch", t, t["step_s"], t["tokens_per_s"]))
    if "ratio_tokens_per_s" in r:
        in_loop = f", in the training loop {r['ratio_tokens_per_s_in_loop']:.1f}x" if "ratio_tokens_per_s_in_loop" in r else ""
        lines += [f"ratio nljax / titans-pytorch tokens/s: {r['ratio_tokens_per_s']:.1f}x "
                  f"(worst pattern {r['ratio_tokens_per_s_worst']:.1f}x){in_loop}",
                  f"ratio of outer-loop FLOP/s (tokens/s x 6N): {r['ratio_outer_flops_per_s']:.1f}x; "
                  f"of tokens/s per outer-loop FLOP/token (tokens/s / 6N): {r['ratio_tokens_per_s_per_outer_flop']:.1f}x"]
    lines.append(f"anchor: {r['anchor']}")
    return "\n".join(lines)


def parse(argv):
    p = argparse.ArgumentParser(prog="benchmarks/titans_pytorch.py", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="titans_demo", help="nljax config (default titans_demo)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2, help="timed interleaved rounds (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda", "gpu"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=1, help="CPU threads each, 0: library defaults (default 1)")
    p.add_argument("--skip-torch", action="store_true", help="time nljax alone")
    p.add_argument("--skip-nljax", action="store_true",
                   help="time titans-pytorch alone (on CPU at 4 x 512 both need more than 23 GB together)")
    p.add_argument("--out", metavar="FILE.json")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="nljax config overrides")
    return p.parse_args(argv)


def main(argv=None) -> int:
    # Run as a script, this file's folder comes first on sys.path, where `titans_pytorch` would
    # be this file rather than the library.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    args = parse(argv)
    pin_threads(args)  # before torch and jax start
    if args.device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from nljax.errors import ConfigError
    from nljax.measure import hostmem

    # as nljax's commands do (NLJAX_HOST_MALLOC=system: not); titans-pytorch, in the same
    # process, allocates under the same settings
    try:
        hostmem.retain()
    except ConfigError as e:
        print(f"titans_pytorch.py: error: {e}", file=sys.stderr)
        return 2
    say = lambda s: print(s, flush=True)
    calls, sizes, nl_dtype = {}, {}, "-"
    if not args.skip_nljax:
        steps, sizes["nljax"], nl_dtype = nljax_side(args)
        calls.update({f"nljax {k}": v for k, v in steps.items()})
    if not args.skip_torch:
        try:
            step, tn, tn_mat = torch_side(args)
            calls["titans-pytorch"] = step
            sizes["titans_pytorch"] = {"params": tn, "nonembedding_params": tn_mat}
        except ImportError as e:
            say(f"titans-pytorch part skipped: {e} (pip install -e '.[bench]')")
    # Where the library changes, the heap's free memory goes back to the system: each library's
    # peak kept beside the other's (the retained heap never shrinks) took the 4 x 512 process to
    # 23.0 of this machine's 23 GB, and steps after a switch to 3x their time (memory reclaimed
    # under them). The settling call after the switch faults back in what the next one needs.
    r = report(args, interleaved(calls, args.warmup, args.rounds, say, switch=hostmem.release), sizes, nl_dtype)
    say(format_report(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
        say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
