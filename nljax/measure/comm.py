"""Communication accounting: what each compiled step variant sends, read from its HLO.

The library behind `python -m nljax.comm` (nljax/comm.py): it every Pulse variant of the configured train step, lists each collective (op, mesh axes,
replica groups, bytes per device), and reports the mean bytes per step over one full cycle of
the periods next to a DDP-style baseline that all-reduces every parameter at every step.

"payload" is the buffer a collective reduces or gathers per device; "wire" is what each device
sends with ring algorithms (all-reduce 2(g-1)/g, reduce-scatter and all-gather (g-1)/g of the
payload). Totals and the DDP comparison use wire bytes, so a hierarchical reduction is not
charged three times for the same data.

Each collective's time is projected as wire bytes / link bandwidth, with `sync.intra_bandwidth_gbps`
for collectives inside an `intra` group and `sync.inter_bandwidth_gbps` for any that crosses
`inter` (GB/s per device and direction), and set against a flat ring all-reduce of the same
gradient bytes over all devices, which a slow link bottlenecks (every ring step crosses it when
inter > 1). Latency and overlap with compute are not modelled: the projection compares volumes
on links, not measured times.

Under tensor parallelism (`mesh.model` > 1) the collectives over `model` alone are the
activation reductions of the split sub-blocks (one all-reduce per attention, memory and MLP
forward and one per backward; the DiT adds its modulation's all-gathers), listed with the rest
and totalled apart; the per-level sync and
the DDP baseline are over the data axes, of one device's shard of each level.
"""

from __future__ import annotations

from nljax.config import Config
from nljax.engine import frozen
from nljax.engine.conductor import Conductor, pattern_name
from nljax.engine.state import TrainState
from nljax.engine.step import StepCache
from nljax.measure import hlo
from nljax.parallel import levels
from nljax.parallel.mesh import INTER, INTRA, MODEL, data_size


def variant_collectives(cache: StepCache, active, state: TrainState, batch: dict) -> list[hlo.Collective]:
    """The collectives of pattern `active`'s compiled step. On a one-device mesh there are none to
    read and nothing is compiled for it: a run shorter than a cycle compiled the patterns it did
    not reach only to find none (13 s of a 75 s quick run of the default job on a CPU)."""
    if cache.eng.mesh.devices.size == 1:
        return []
    text = cache.train_fn(active, state, batch).as_text()
    return hlo.collectives(text, dict(cache.eng.mesh.shape))


def link_bandwidth(axes, cfg: Config) -> float:
    """Bytes per second of the slowest link a collective over `axes` uses."""
    gbps = cfg.sync.inter_bandwidth_gbps if INTER in axes else cfg.sync.intra_bandwidth_gbps
    return gbps * 1e9


def flat_all_reduce_time(nbytes: int, mesh_shape: dict, cfg: Config) -> float:
    """Projected seconds of one ring all-reduce of `nbytes` over every device."""
    n = mesh_shape[INTER] * mesh_shape[INTRA]
    axes = (INTER,) if mesh_shape[INTER] > 1 else (INTRA,)
    return hlo.ring_all_reduce_bytes(nbytes, n) / link_bandwidth(axes, cfg)


def comm_per_step(cache: StepCache, state: TrainState, batch: dict) -> dict:
    """The communication of one step of each pulse pattern, read from the compiled HLO, its mean
    over a cycle and its ratio to DDP: the report of `python -m nljax.comm`, as a JSON-ready dict."""
    eng = cache.eng
    cfg, mesh_shape = eng.cfg, dict(eng.mesh.shape)
    # one device's share of each level: its tensor-parallel shard (the whole level when mesh.model=1)
    sizes = [b for _, b in levels.level_sizes(eng.levels.shapes, eng.level_tree, eng.n_levels)]
    conductor = Conductor(eng.cfg.cms.periods)
    patterns = conductor.patterns()
    variants = []
    for active, count in sorted(patterns.items(), key=lambda kv: -kv[1]):
        colls = variant_collectives(cache, active, state, batch)
        # per step: a collective inside a loop (layers scanned, micro-batches) runs `count` times
        times = [c.count * c.wire_bytes / link_bandwidth(c.axes, cfg) for c in colls]
        # what the sync reduces: C_l gradients of a level under cms.accumulate=updates (frozen.slots)
        grad_bytes = sum(b * frozen.slots(eng, l) for l, (b, a) in enumerate(zip(sizes, active)) if a)
        wire = sum(c.count * c.wire_bytes for c in colls)
        tp_wire = sum(c.count * c.wire_bytes for c in colls if c.axes == (MODEL,))
        sync_time = sum(t for c, t in zip(colls, times) if c.axes != (MODEL,))
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
                        "payload_bytes": c.bytes,  # of one execution
                        "wire_bytes": c.wire_bytes,
                        "count": c.count,  # executions per step
                        "projected_time_s": t,  # of all of them
                    }
                    for c, t in zip(colls, times)
                ],
                "payload_bytes": sum(c.count * c.bytes for c in colls),
                "wire_bytes": wire,
                # tensor parallelism's activation reductions (over `model` alone), apart from the
                # per-level sync of the data axes
                "model_axis_wire_bytes": tp_wire,
                "data_axes_wire_bytes": wire - tp_wire,
                "gradient_bytes": grad_bytes,
                "projected_time_s": sum(times),
                "sync_projected_time_s": sync_time,  # of the per-level sync alone
                "flat_all_reduce_time_s": flat_all_reduce_time(grad_bytes, mesh_shape, cfg),
            }
        )
    cycle = conductor.cycle
    mean = lambda key: sum(v[key] * v["steps_per_cycle"] for v in variants) / cycle  # per step, over a cycle
    mean_wire, mean_tp = mean("wire_bytes"), mean("model_axis_wire_bytes")
    param_bytes = sum(sizes)
    ddp = hlo.ring_all_reduce_bytes(param_bytes, data_size(eng.mesh))
    return {
        "mesh": mesh_shape,
        "strategy": eng.strategy.name,
        "reduce": eng.cfg.sync.reduce,
        "bandwidth_gbps": {"intra": cfg.sync.intra_bandwidth_gbps, "inter": cfg.sync.inter_bandwidth_gbps},
        "frozen_grads": eng.cfg.cms.frozen_grads,
        "periods": list(eng.cfg.cms.periods),
        "cycle_steps": cycle,
        "param_bytes_per_level": sizes,
        "variants": variants,
        "mean_wire_bytes_per_step": mean_wire,
        "mean_model_axis_wire_bytes_per_step": mean_tp,
        "ddp_wire_bytes_per_step": ddp,
        # the sync against DDP's: tensor parallelism's activation traffic is the same for both
        "ratio_vs_ddp": ((mean_wire - mean_tp) / ddp) if ddp else None,
        "mean_projected_time_s": mean("projected_time_s"),
        "mean_sync_projected_time_s": mean("sync_projected_time_s"),
        "mean_flat_all_reduce_time_s": mean("flat_all_reduce_time_s"),
    }


def format_report(r: dict) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    per_level = "; ".join(f"L{i} {b:,}" for i, b in enumerate(r["param_bytes_per_level"]))  # commas: thousands
    lines = [
        f"mesh {mesh}   strategy={r['strategy']}   reduce={r['reduce']}   frozen_grads={r['frozen_grads']}   "
        f"periods={r['periods']} (cycle {r['cycle_steps']} steps)",
        f"parameter bytes per level (one device's tensor-parallel shard): {per_level}"
        if r["mesh"].get(MODEL, 1) > 1 else f"parameter bytes per level: {per_level}",
        f"links: intra {r['bandwidth_gbps']['intra']:g} GB/s, inter {r['bandwidth_gbps']['inter']:g} GB/s per device",
        "",
        f"{'variant':<12}{'steps/cycle':>12}  {'op':<16}{'axes':<14}{'groups':>7}{'runs':>6}{'payload B':>14}"
        f"{'wire B':>14}{'time us':>10}",
    ]
    us = lambda t: f"{t * 1e6:,.1f}"
    for v in r["variants"]:
        first = True
        for c in v["collectives"] or [None]:
            head = f"{v['active']:<12}{v['steps_per_cycle']:>12}  " if first else " " * 26
            first = False
            if c is None:
                lines.append(head + "(no collectives)")
                continue
            shown = c["replica_groups"][:4]
            groups = " ".join("{" + ",".join(map(str, g)) + "}" for g in shown)
            groups += " ..." if len(c["replica_groups"]) > len(shown) else ""
            lines.append(
                head + f"{c['op']:<16}{'+'.join(c['axes']):<14}{len(c['replica_groups']):>7}{c['count']:>6}"
                f"{c['payload_bytes']:>14,d}{c['wire_bytes']:>14,.0f}{us(c['projected_time_s']):>10}  {groups}"
            )
        if v["gradient_bytes"]:
            lines.append(
                " " * 26 + f"projected sync {us(v['sync_projected_time_s'])} us vs flat all-reduce of the "
                f"{v['gradient_bytes']:,d} gradient bytes {us(v['flat_all_reduce_time_s'])} us"
            )
    tp = r["mean_model_axis_wire_bytes_per_step"]
    lines += [
        "",
        f"mean wire bytes per device per step: {r['mean_wire_bytes_per_step']:,.0f}"
        + (f" ({tp:,.0f} of them tensor-parallel activations over `model`, "
           f"{r['mean_wire_bytes_per_step'] - tp:,.0f} the per-level sync over the data axes)" if tp else ""),
        f"DDP baseline (all parameters, every step): {r['ddp_wire_bytes_per_step']:,.0f}",
    ]
    if r["ratio_vs_ddp"] is not None:
        lines.append(f"ratio nljax / DDP: {r['ratio_vs_ddp']:.3f}")
    if r["mean_flat_all_reduce_time_s"]:
        lines.append(
            f"projected communication time per step: {us(r['mean_projected_time_s'])} us, of which the sync "
            f"{us(r['mean_sync_projected_time_s'])} us; flat all-reduce of the same gradients: "
            f"{us(r['mean_flat_all_reduce_time_s'])} us "
            f"({r['mean_flat_all_reduce_time_s'] / max(r['mean_sync_projected_time_s'], 1e-30):.2f}x)"
        )
    return "\n".join(lines)
