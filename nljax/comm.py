"""Communication accounting: what each compiled step variant sends, read from its HLO.

    python -m nljax.comm [--config FILE] [--cpu-devices N] [--json] [key=value ...]

compiles every Pulse variant of the configured train step, lists each collective (op, mesh axes,
replica groups, bytes per device), and reports the mean bytes per step over one full cycle of
the periods next to a DDP-style baseline that all-reduces every parameter at every step.

"payload" is the buffer a collective reduces or gathers per device; "wire" is what each device
sends with ring algorithms (all-reduce 2(g-1)/g, reduce-scatter and all-gather (g-1)/g of the
payload). Totals and the DDP comparison use wire bytes, so a hierarchical reduction is not
charged three times for the same data.
"""

from __future__ import annotations

import json
import sys

import jax

from nljax import cli, hlo, levels
from nljax.conductor import Conductor, pattern_name
from nljax.config import Config
from nljax.mesh import data_size
from nljax.step import StepCache
from nljax.state import TrainState


def variant_collectives(cache: StepCache, active, state: TrainState, batch: dict) -> list[hlo.Collective]:
    text = cache.train_fn(active, state, batch).as_text()
    return hlo.collectives(text, dict(cache.eng.mesh.shape))


def account(cache: StepCache, state: TrainState, batch: dict) -> dict:
    """The report, as a JSON-ready dict."""
    eng = cache.eng
    conductor = Conductor(eng.cfg.cms.periods)
    patterns = conductor.patterns()
    variants = []
    for active, count in sorted(patterns.items(), key=lambda kv: -kv[1]):
        colls = variant_collectives(cache, active, state, batch)
        variants.append(
            {
                "active": pattern_name(active),
                "active_levels": [l for l, a in enumerate(active) if a],
                "steps_per_cycle": count,
                "collectives": [
                    {
                        "op": c.op,
                        "axes": list(c.axes),
                        "group_size": c.group_size,
                        "replica_groups": [list(g) for g in c.groups],
                        "dtype": c.dtype,
                        "payload_bytes": c.bytes,
                        "wire_bytes": c.wire_bytes,
                    }
                    for c in colls
                ],
                "payload_bytes": sum(c.bytes for c in colls),
                "wire_bytes": sum(c.wire_bytes for c in colls),
            }
        )
    cycle = conductor.cycle
    mean_wire = sum(v["wire_bytes"] * v["steps_per_cycle"] for v in variants) / cycle
    param_bytes = sum(b for _, b in levels.level_sizes(state.params, eng.level_tree, eng.n_levels))
    ddp = hlo.ring_all_reduce_bytes(param_bytes, data_size(eng.mesh))
    return {
        "mesh": dict(eng.mesh.shape),
        "reduce": eng.cfg.sync.reduce,
        "frozen_grads": eng.cfg.cms.frozen_grads,
        "periods": list(eng.cfg.cms.periods),
        "cycle_steps": cycle,
        "param_bytes_per_level": [b for _, b in levels.level_sizes(state.params, eng.level_tree, eng.n_levels)],
        "variants": variants,
        "mean_wire_bytes_per_step": mean_wire,
        "ddp_wire_bytes_per_step": ddp,
        "ratio_vs_ddp": (mean_wire / ddp) if ddp else None,
    }


def format_report(r: dict) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [
        f"mesh {mesh}   reduce={r['reduce']}   frozen_grads={r['frozen_grads']}   periods={r['periods']} "
        f"(cycle {r['cycle_steps']} steps)",
        f"parameter bytes per level: {r['param_bytes_per_level']}",
        "",
        f"{'variant':<12}{'steps/cycle':>12}  {'op':<16}{'axes':<14}{'groups':>7}{'payload B':>14}{'wire B':>14}",
    ]
    for v in r["variants"]:
        first = True
        for c in v["collectives"] or [None]:
            head = f"{v['active']:<12}{v['steps_per_cycle']:>12}  " if first else " " * 26
            first = False
            if c is None:
                lines.append(head + "(no collectives)")
                continue
            lines.append(
                head + f"{c['op']:<16}{'+'.join(c['axes']):<14}{len(c['replica_groups']):>7}"
                f"{c['payload_bytes']:>14,d}{c['wire_bytes']:>14,.0f}"
            )
    lines += [
        "",
        f"mean wire bytes per device per step: {r['mean_wire_bytes_per_step']:,.0f}",
        f"DDP baseline (all parameters, every step): {r['ddp_wire_bytes_per_step']:,.0f}",
    ]
    if r["ratio_vs_ddp"] is not None:
        lines.append(f"ratio nljax / DDP: {r['ratio_vs_ddp']:.3f}")
    return "\n".join(lines)


def _run(args, cfg: Config) -> int:
    from nljax.trainer import Setup  # deferred: trainer imports this module

    setup = Setup.create(cfg)
    batch = setup.batch(0)
    report = account(setup.cache, setup.state, batch)
    if jax.process_index() == 0:  # only process 0 prints
        print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def main(argv=None) -> int:
    p = cli.parser("nljax.comm", "Bytes moved by every compiled step variant, read from the HLO.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return cli.main(_run, p, argv)


if __name__ == "__main__":
    sys.exit(main())
