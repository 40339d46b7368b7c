"""A config's training step compiled for a GPU on a machine without one: whether every GPU path
compiles, how many kernels a step launches, how much memory it holds.

    pip install "jax[cuda13]==<this jax's version>"   # once, beside nljax: XLA:GPU's compiler (about 4 GB)
    python benchmarks/gpu_compile.py --gpu h200 --config nl_350m [--variant NAME:key=value,...]
                                     [--precision highest] [--no-base] [--out F.json]
                                     [--save-executables DIR] [--autotune DIR] [key=value ...]

XLA compiles for a GPU it describes from a target config (`GPUS`: the card's SM count, shared
memory, memory size and bandwidth) through a GPU topology's compile-only devices
(`jax.experimental.topologies`), with the HLO passes, fusion decisions and Triton and cuDNN
lowerings it runs on the card itself, except what needs the card: matmul autotuning (it takes
default Triton tiles, and no cuBLAS call where the card's timings might pick one). Nothing runs. The model is built and traced for the GPU
(`nljax.models.platform.compiling_for`): `auto` takes the forms it takes on a GPU, its probes
compile for the described card, and the Pallas kernels are compiled, not interpreted. The
state and the batch are shapes, not arrays (`abstract_inputs`). For each variant (the config's
own forms first, then each `--variant`, its overrides after the command line's) it reports:

- `compiled`: whether XLA:GPU compiled the step, or its error in one line; `compile_s` on this
  machine;
- `forms`: what the model computes with (attention, the inner loop, the embedding's gradient);
- `launches`: the kernels one step launches, estimated from the compiled program
  (`nljax.measure.hlo.launching`), by kind, and `launches_by_scope` by where in the model they
  were written (`nljax.measure.traces.scope`: pass and module). At batch 4 titans_demo's step is
  bound by its kernel count, not its FLOPs (docs/performance);
- `memory`: XLA's buffer assignment, bytes: arguments (parameters, optimizer state, batch),
  outputs not aliased to them, and temporaries; `peak` is their sum, the device memory the step
  needs before the allocator's and the libraries' own; `fits`: whether that is within the card's
  memory (nljax's own start-up check reads a device's memory, which a compile-only device has
  not).

`--save-executables DIR` writes each variant's executable to DIR under the key a run on the card
computes for the same step (nljax/engine/executables.py), for a GPU session to load instead of
compiling (`NLJAX_EXECUTABLES=DIR`; benchmarks/gpu_prepare.sh does it for the GPU suite's parts),
and reports each file's size. `--autotune DIR` compiles with XLA's autotuning results from the
card (the GPU suite's OUT/autotune/NAME): XLA takes the card's tiles and cuBLAS calls for the
fusions found there, its defaults for the others (docs/guides/gpu.md, "Executables compiled
ahead", says how many were found).

Install the jax version of the GPU machine the figures are for: each brings its own XLA and
Triton (with jax 0.11.2, the H200 host's, a step's kernels were the profiler's count within 1%
and a kernel over a block's shared memory was refused as on the card; jax 0.10.2 missed both).
How close the estimates are to a GPU's measurements is on the GPU guide
(docs/guides/gpu.md, "Compiling for a GPU without one"). Exits 1 when a variant does not compile
or does not fit.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import jax

# What XLA knows of a card when it has none to ask (XLA's GpuDeviceInfoProto, a text proto):
# Hopper's SMs and shared memory (an H100 and an H200 have the same chip), each card's memory.
_HOPPER = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
               shared_memory_per_core=233472, threads_per_core_limit=2048, core_count=132, fpus_per_core=128,
               block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535,
               l2_cache_size=52428800, clock_rate_ghz=1.98, shared_memory_per_block_optin=232448,
               registers_per_core_limit=65536, registers_per_block_limit=65536)
GPUS = {
    "h100": ("NVIDIA H100 80GB HBM3", dict(_HOPPER, memory_bandwidth=3352320000000, device_memory_size=84929347584)),
    # The L2 and the bandwidth as the H200's XLA describes the card (60 MiB, 4814 GB/s rounded):
    # XLA's autotuning results are filed under a fingerprint of "CUDA: 9.0, Cores: 132, GPU
    # clock: 1.98 GHz, Memory bandwidth: 4814 GB/s, L2 cache: 60 MB" (the folder ed0e56ab8b2a0ecb
    # the suite brought back on 2026-11-30; the 50 MiB and 4800 GB/s described before gave
    # a4baa03864db7cfb), and `--autotune` reads them only under the same fingerprint
    "h200": ("NVIDIA H200", dict(_HOPPER, l2_cache_size=62914560, memory_bandwidth=4814000000000,
                                 device_memory_size=150754820096)),
}


# The CUDA driver and toolkit of the card's host (the H200's: driver 580.159.04, CUDA 13.0). XLA
# decides from them what goes into command buffers (CUDA graphs): without them it takes 0.0 and
# keeps cuDNN, cuBLAS, while loops and dynamic-slice fusions out of the graphs, as on no CUDA 13
# host (docs/benchmarks/2026-12-01-command-buffers.md); the compiled HLO is the same either way
CUDA = "13.0.0"


def target_config(gpu: str) -> str:
    """XLA's target config (text proto) of `gpu`, a key of GPUS: CUDA 13 (jax[cuda13]'s: the
    runtime, the driver and the toolkit) and the cuDNN of the wheel installed here, as the plugin
    would find them on the card's host."""
    name, info = GPUS[gpu]
    info = dict(info, driver_version=f'"{CUDA}"', compile_time_toolkit_version=f'"{CUDA}"')
    fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
    cudnn = _cudnn_version()
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: 9 }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} }}\n'
            f'runtime_version {{ major: 13 minor: 0 }}\ndevice_description_str: "{name}"\n')


def _cudnn_version() -> tuple[int, int]:
    from importlib import metadata

    for dist in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            major, minor = metadata.version(dist).split(".")[:2]
            return int(major), int(minor)
        except metadata.PackageNotFoundError:
            continue
    return 9, 8


def gpu_device(gpu: str):
    """The compile-only device of one `gpu`; a SystemExit naming the fix when XLA:GPU's compiler
    is not installed."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(gpu), topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - no CUDA plugin: jax raises several kinds
        raise SystemExit(f"gpu_compile: XLA:GPU's compiler is not installed here ({type(e).__name__}); "
                         f'pip install "jax[cuda13]=={jax.__version__}" beside nljax') from None
    return topo.devices[0]


def abstract_inputs(run, host_mesh):
    """The all-levels step's inputs as shapes on `run`'s devices: the state from
    `jax.eval_shape` (nothing allocated), the batch's shapes and dtypes from the task's first
    batch built on `host_mesh` (CPU devices: the data are read and cut as for training)."""
    from jax.sharding import NamedSharding

    from nljax.run import tasks

    state = jax.eval_shape(run.init_state)
    task = tasks.build(getattr(run.engine.model, "task", "text"), run.cfg, host_mesh)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(run.mesh, v.sharding.spec))
             for k, v in task.batch(0).items()}
    return state, batch


def compiled_step(cfg, device, host_device, save: Path | None = None):
    """(the run, the compiled all-levels step) of `cfg` on one `device`, built and traced for its
    platform; `host_device` (a CPU) reads the data. `save`: a directory the executable is written
    to, under the key a run on the card computes (nljax/engine/executables.py)."""
    from nljax.engine import executables
    from nljax.models import platform
    from nljax.parallel import mesh as meshlib
    from nljax.run.core import Run

    with platform.compiling_for("gpu" if device.platform in ("gpu", "cuda") else device.platform, device):
        run = Run.create(cfg, [device])
        # written, never read: a compile-only device cannot load an executable
        run.cache.executables = None if save is None else executables.Store(save, write=True, read=False)
        state, batch = abstract_inputs(run, meshlib.make_mesh(1, 1, [host_device], 1))
        with platform.lowering():
            return run, run.cache.train_fn(tuple(True for _ in cfg.cms.periods), state, batch)


def compile_step(cfg, device, host_device, memory_bytes: int | None = None, save: Path | None = None) -> dict:
    """One variant's report (module docstring) for `cfg` on one `device` of `memory_bytes`;
    with `save`, the executable's file and bytes (`executable`), or null where it was not written."""
    from nljax.errors import first_line

    t0 = time.perf_counter()
    try:
        run, fn = compiled_step(cfg, device, host_device, save)
    except Exception as e:  # noqa: BLE001 - the compiler's error is the result
        return dict(compiled=f"{type(e).__name__}: {first_line(e)}"[:400])
    out = dict(report(run, fn), compile_s=round(time.perf_counter() - t0, 1))
    if memory_bytes is not None:
        out["memory"]["fits"] = out["memory"]["peak"] <= memory_bytes
    if save is not None:
        written = next(iter(run.cache.written.values()), None)
        out["executable"] = None if written is None else dict(file=str(written), bytes=written.stat().st_size)
    return out


def report(run, fn) -> dict:
    """What a compiled step asks of its device: forms, kernel launches, memory (module docstring)."""
    from nljax.measure import hlo, traces

    model = run.engine.model
    text, launches, scopes = fn.as_text(), {}, {}
    for kind, times, line in hlo.launching(text):
        launches[kind] = launches.get(kind, 0) + times
        where = traces.scope(op[1]) if (op := re.search(r'op_name="([^"]*)"', line)) else "?"
        scopes[where] = scopes.get(where, 0) + times
    m = fn.memory_analysis()
    outputs = m.output_size_in_bytes - m.alias_size_in_bytes
    return dict(compiled=True, forms=model.forms() if hasattr(model, "forms") else None,
                launches=dict(launches, total=sum(launches.values())),
                launches_by_scope=dict(sorted(scopes.items(), key=lambda kv: -kv[1])),
                memory=dict(arguments=m.argument_size_in_bytes, outputs=outputs, temporaries=m.temp_size_in_bytes,
                            peak=m.argument_size_in_bytes + outputs + m.temp_size_in_bytes))


def _line(name: str, r: dict) -> str:
    if r["compiled"] is not True:
        return f"{name}: DOES NOT COMPILE: {r['compiled']}"
    forms = ", ".join(f"{k} {v}" for k, v in (r["forms"] or {}).items() if v is not None)
    k, m = r["launches"], r["memory"]
    kinds = ", ".join(f"{n} {v:,}" for n, v in k.items() if n != "total" and v)
    where = ", ".join(f"{s} {v:,}" for s, v in list(r["launches_by_scope"].items())[:8])
    over = " (MORE THAN THE CARD HAS)" if m.get("fits") is False else ""
    saved = ""
    if "executable" in r:
        e = r["executable"]
        saved = "\n  executable NOT WRITTEN (the line above says why)" if e is None else \
            f"\n  executable {e['file']} ({e['bytes'] / 2**20:.1f} MiB)"
    return (f"{name}: {k['total']:,} kernels per step ({kinds}); memory {m['peak'] / 1e9:.1f} GB{over} "
            f"(arguments {m['arguments'] / 1e9:.2f}, temporaries {m['temporaries'] / 1e9:.2f}); "
            f"compiled in {r['compile_s']} s here" + (f"; {forms}" if forms else "") + f"\n  most kernels: {where}"
            + saved)


def use_autotune_results(directory: Path) -> None:
    """Compile with XLA's per-fusion autotuning results in `directory` (the folder the GPU suite
    brings back, OUT/autotune/NAME, holding one folder per device fingerprint): XLA reads them
    without a card and writes nothing there without one (checked with jax 0.11.2). Set before
    XLA reads its flags (the first compilation)."""
    if not directory.is_dir():
        raise SystemExit(f"gpu_compile: --autotune {directory}: not a directory")
    import os

    flag = f"--xla_gpu_per_fusion_autotune_cache_dir={directory}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="the card to compile for")
    p.add_argument("--config", required=True, help="a packaged config or a YAML file")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...",
                   help="also compile with these overrides (repeatable)")
    p.add_argument("--no-base", action="store_true", help="compile the variants only")
    p.add_argument("--precision", choices=("default", "high", "highest"), default="default",
                   help="jax_default_matmul_precision while tracing (benchmarks/memory_kernel.py checks at highest)")
    p.add_argument("--out", help="write the reports here as JSON")
    p.add_argument("--save-executables", metavar="DIR", type=Path,
                   help="write each variant's executable here, for a run on the card to load (NLJAX_EXECUTABLES=DIR)")
    p.add_argument("--autotune", metavar="DIR", type=Path,
                   help="XLA's autotuning results from the card (the GPU suite's OUT/autotune/NAME): its matmul "
                        "tiles and library calls where the fusion is the card's, default tiles elsewhere")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="for every variant")
    args = p.parse_args(argv)
    if args.autotune is not None:
        use_autotune_results(args.autotune)
    jax.config.update("jax_platforms", "cpu")  # this process computes nothing on a GPU
    if args.precision != "default":
        jax.config.update("jax_default_matmul_precision", args.precision)
    from nljax import config
    from nljax.errors import ConfigError

    variants = [] if args.no_base else [("config", [])]
    for v in args.variant:
        name, _, rest = v.partition(":")
        variants.append((name, [o for o in rest.split(",") if o]))
    device, host = gpu_device(args.gpu), jax.devices("cpu")[0]
    print(f"compiling for one {device.device_kind} ({args.gpu}) with jax {jax.__version__}, on this CPU machine",
          flush=True)
    reports, failed = {}, False
    for name, extra in variants:
        try:
            cfg = config.load(args.config, [*args.overrides, *extra])
        except ConfigError as e:
            raise SystemExit(f"gpu_compile: variant {name}: {e}") from None
        reports[name] = r = compile_step(cfg, device, host, GPUS[args.gpu][1]["device_memory_size"],
                                         args.save_executables)
        failed |= r["compiled"] is not True or r["memory"]["fits"] is False or r.get("executable", True) is None
        print(_line(name, r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(gpu=args.gpu, device_kind=device.device_kind, jax=jax.__version__,
                                                  config=args.config, overrides=args.overrides,
                                                  precision=args.precision,
                                                  autotune=None if args.autotune is None else str(args.autotune),
                                                  variants=reports),
                                             indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
