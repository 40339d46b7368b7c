"""The run's plots in `run.dir`: loss.png and step_time.png (written by nljax/run/trainer.py at
the end of a run, from the metrics.jsonl records).

Made to be read without help: every axis in plain numbers (no offset such as "1e-5+9.999e-1", no
"1.7x10^3" on a log axis), legends beside the data rather than over it, a text loss in bits per
byte beside nats (as the log prints `eval_bpb`), and a MeanFlow run's loss plotted with what says
more than its adaptively weighted loss (near 1 at every step with the default weight): the
held-out squared error without the weight, and the energy distance of its samples."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

# metrics.jsonl keys -> what the legend says
LABELS = {
    "loss": "training loss",
    "eval_loss": "held-out loss (fresh memory)",
    "eval_loss_stream": "held-out loss (memory carried)",
    "eval_bpb": "held-out bits per byte (fresh memory)",
    "eval_bpb_stream": "held-out bits per byte (memory carried)",
    "eval_mse": "held-out squared error (unweighted)",
    "eval_energy_1step": "one-step samples",
    "eval_energy_multistep": "multi-step samples",
}


def label(key: str) -> str:
    """The legend of a metrics.jsonl key; a data.eval_sets set's key (`eval_loss/<name>`) is its
    metric's, with the set's name."""
    base, _, name = key.partition("/")
    return f"{LABELS.get(base, base)}, {name}" if name else LABELS.get(key, key)


def plain(axis) -> None:
    """Plain tick labels on a linear axis: no offset, no scientific notation."""
    f = ScalarFormatter(useOffset=False)
    f.set_scientific(False)
    axis.set_major_formatter(f)


def plain_log(axis) -> None:
    """A log axis labelled in plain numbers (20, 50, 100, not 2x10^1): the decades, and 2 and 5
    between them."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def legend_beside(ax) -> None:
    """The legend right of the axes, outside the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, frameon=False)


def series(records: list[dict], final: dict, key: str) -> list[tuple[int, float]]:
    """(steps done, value) of `key`: an evaluation's record is after step s, i.e. s + 1 steps;
    the final evaluation after the last step."""
    pts = [(r["step"] + 1, r[key]) for r in records if r.get(key) is not None]
    if final.get(key) is not None and records:
        pts.append((records[-1]["step"] + 1, final[key]))
    return pts


def figure(figsize: tuple[float, float]) -> Figure:
    """A figure drawn by Agg, for a file, outside pyplot: `matplotlib.use("Agg")` switched the
    process's backend, so a notebook that trained showed none of its own plots afterwards."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> None:
    for ax in fig.axes:  # steps are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(path, dpi=100, bbox_inches="tight")  # the legend beside the axes is kept in


def loss_figure(records: list[dict], final: dict | None = None, bpb_per_nat: float | None = None):
    """loss.png's figure: a language model's losses in nats with bits per byte on the right
    (`bpb_per_nat`: bits per byte in one nat per token), or, where the records hold energy
    distances (a MeanFlow run), three panels: the training loss, the held-out unweighted error,
    the energy distance. Each held-out text has one colour (the main one, then each
    data.eval_sets set), its fresh-memory curve solid and its memory-carried one dashed; with
    sets, whose tokens per byte differ from the main text's, their bits per byte are a panel of
    their own below the losses (the right axis would read the main text's ratio alone)."""
    final = final or {}
    keys = {k for r in [*records, final] for k in r}
    if any(k.startswith("eval_energy") for k in keys):
        return _image_loss_figure(records, final)
    texts = held_out_texts([*records, final])
    bpb_panel = len(texts) > 1 and any(k.partition("/")[0] in BPB for k in keys)
    if bpb_panel:
        fig = figure((8, 6.5))
        ax, low = fig.subplots(2, 1, sharex=True)
    else:
        fig = figure((8, 4))
        ax = fig.subplots()
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1, color="C0", label=LABELS["loss"])
    for i, name in enumerate(texts):
        color = f"C{(i + 1) % 10}"  # C0 is the training loss's
        for kind, style in (("", "o-"), ("_stream", "s--")):
            for panel, base in ((ax, f"eval_loss{kind}"), (low if bpb_panel else None, f"eval_bpb{kind}")):
                key = base + (f"/{name}" if name else "")
                pts = series(records, final, key) if panel is not None and key in keys else []
                if pts:
                    panel.plot(*zip(*pts), style, ms=4, color=color, label=label(key))
    ax.set_ylabel("loss (nats per token)")
    plain(ax.yaxis)
    ax.grid(alpha=0.3)
    if bpb_panel:
        low.set_ylabel("bits per byte\n(each text's own)")
        low.set_xlabel("step")
        plain(low.yaxis)
        low.grid(alpha=0.3)
        legend_beside(ax)  # the colours and line styles are the same below
        return fig
    ax.set_xlabel("step")
    if bpb_per_nat:
        right = ax.secondary_yaxis("right", functions=(lambda n: n * bpb_per_nat, lambda b: b / bpb_per_nat))
        right.set_ylabel("bits per byte")
        plain(right.yaxis)
        # the right side holds the second axis: the legend goes below
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=8, frameon=False)
    else:
        legend_beside(ax)
    return fig


BPB = ("eval_bpb", "eval_bpb_stream")


def held_out_texts(records: list[dict]) -> list[str]:
    """The held-out texts whose losses the records hold, in the order they were first logged: ''
    for the run's main one, then each data.eval_sets set's name (`eval_loss/<name>`; a set's
    name is not read: it may hold "loss")."""
    out: dict[str, None] = {}
    for r in records:
        for k in r:
            base, _, name = k.partition("/")
            if base in ("eval_loss", "eval_loss_stream"):
                out.setdefault(name)
    return sorted(out, key=lambda name: name != "")  # the main text first, the sets as logged


def _image_loss_figure(records: list[dict], final: dict):
    fig = figure((8, 8))
    top, mid, low = fig.subplots(3, 1, sharex=True)
    top.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1, label=LABELS["loss"])
    top.set_ylabel("training loss\n(adaptively weighted)")
    pts = series(records, final, "eval_mse")
    if pts:
        mid.plot(*zip(*pts), "o-", ms=4, color="C1", label=LABELS["eval_mse"])
    mid.set_ylabel("held-out squared error\n(unweighted, per value)")
    steps = next((r["eval_sample_steps"] for r in [final, *reversed(records)] if "eval_sample_steps" in r), None)
    for key, color in (("eval_energy_1step", "C2"), ("eval_energy_multistep", "C3")):
        pts = series(records, final, key)
        label = LABELS[key] + (f" ({steps} steps)" if key.endswith("multistep") and steps else "")
        if pts:
            low.plot(*zip(*pts), "o-", ms=4, color=color, label=label)
    low.set_ylabel("energy distance\n(to held-out images)")
    low.set_xlabel("step")
    for ax in (top, mid, low):
        plain(ax.yaxis)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            legend_beside(ax)
    return fig


def step_time_figure(records: list[dict], timed: dict):
    """step_time.png's figure: each training step's time by pulse pattern (the steps that
    compiled left out), with the medians timed at the end as dashed lines."""
    fig = figure((8, 4))
    ax = fig.subplots()
    names = sorted({r["pattern"] for r in records}, key=lambda n: (n.count("+"), n))
    values = []
    for i, name in enumerate(names):
        pts = [(r["step"], r["step_time_s"] * 1e3) for r in records if r["pattern"] == name and not r["compiled"]]
        color = f"C{i % 10}"
        if pts:
            ax.plot(*zip(*pts), ".", ms=4, color=color, label=f"{name} (training)")
            values += [v for _, v in pts]
        if name in timed:
            ax.axhline(timed[name]["step_time_ms"], color=color, ls="--", lw=1, label=f"{name} (timed, median)")
            values.append(timed[name]["step_time_ms"])
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    if values and min(values) > 0 and max(values) / min(values) > 20:  # a wide range: log, in plain numbers
        ax.set_yscale("log")
        plain_log(ax.yaxis)
    else:
        plain(ax.yaxis)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        legend_beside(ax)
    return fig


NAMES = ("loss.png", "step_time.png")  # what `write` makes in run.dir

MOST_STEPS = 20_000  # a figure's steps of each pattern at most: 800 pixels wide, it shows no more


def thinned(records: Iterable[dict], total: int, most: int = MOST_STEPS) -> list[dict]:
    """What the figures draw of `total` records, read as they come: all of them up to `most`;
    above, every k-th record of each step pattern (every k-th of a cycle's steps would all be
    one pattern's), every record holding an evaluation, and the last (the final evaluation is
    drawn after it). A long run's figures then take a bounded time and memory to draw."""
    k = max(1, -(-total // most))
    seen: dict = {}
    out, last = [], None
    for last in records:
        n = seen[last.get("pattern")] = seen.get(last.get("pattern"), -1) + 1
        if n % k == 0 or any(key.startswith("eval_") for key in last):
            out.append(last)
    if last is not None and (not out or out[-1] is not last):
        out.append(last)
    return out


def write(path: Path, records: list[dict], timed: dict, final_eval: dict | None = None,
          bpb_per_nat: float | None = None) -> list[str]:
    """loss.png and step_time.png in `path`; returns the names written."""
    if not records:
        return []
    _save(loss_figure(records, final_eval, bpb_per_nat), Path(path) / "loss.png")
    _save(step_time_figure(records, timed), Path(path) / "step_time.png")
    return ["loss.png", "step_time.png"]
