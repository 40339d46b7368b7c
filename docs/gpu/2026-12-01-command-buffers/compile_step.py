"""titans_demo's training step (bf16, batch 4 x 512) compiled for an H200 on a machine without one
(benchmarks/gpu_compile.py's compile), under this process's XLA_FLAGS: writes the compiled HLO text
to OUT and its kernel count (nljax.measure.hlo.launching) to OUT.json. With XLA_FLAGS naming
--xla_dump_to, XLA also writes the step's thunk sequence before and after its thunk passes (the
command buffers are formed there, not in the HLO).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python compile_step.py OUT [--no-driver] [key=value ...]

--no-driver: leave the card's CUDA driver and toolkit out of XLA's target config, as
benchmarks/gpu_compile.py did before this folder's commit: XLA then takes them for 0.0 and keeps
command buffers to kernels, copies and loops free of dynamic slices, where the card's driver (the
H200 host's 580.159.04: CUDA 13.0) takes cuDNN, cuBLAS, custom calls and dynamic-slice fusions
into them too, and loops with `+WHILE`.
"""

import json
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")

from benchmarks import gpu_compile  # noqa: E402  (the checkout on PYTHONPATH)
from nljax import config  # noqa: E402


def main(argv):
    out, rest = Path(argv[0]), argv[1:]
    if rest[:1] == ["--no-driver"]:
        rest, with_driver = rest[1:], gpu_compile.target_config

        def without_driver(gpu):
            return "\n".join(line for line in with_driver(gpu).split("\n")
                             if not line.strip().startswith(("driver_version:", "compile_time_toolkit_version:")))

        gpu_compile.target_config = without_driver
    cfg = config.load("titans_demo", ["model.dtype=bfloat16", *rest])
    t0 = time.perf_counter()
    run, fn = gpu_compile.compiled_step(cfg, gpu_compile.gpu_device("h200"), jax.devices("cpu")[0])
    out.write_text(fn.as_text())
    report = dict(gpu_compile.report(run, fn), compile_s=round(time.perf_counter() - t0, 1))
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    print(report["launches"], report["compile_s"], "s")


if __name__ == "__main__":
    main(sys.argv[1:])
