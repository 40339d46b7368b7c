"""The run's plots read without help: plain tick labels (no offset such as "1e-5+9.999e-1", no
"1.7x10^3" on a log axis), legends outside the axes, a text loss in bits per byte beside nats, a
MeanFlow run's unweighted error and energy distance plotted; sample grids titled and labelled."""

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from nljax.measure import figures, plots  # noqa: E402


def tick_texts(fig) -> list[str]:
    fig.canvas.draw()
    out = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            out += [t.get_text() for t in axis.get_ticklabels(which="both")] + [axis.get_offset_text().get_text()]
    return out


def legends_outside(fig) -> bool:
    """Every legend's box lies outside its axes' data area."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is not None and leg.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)):
            return False
    return True


def records(n=40, loss=lambda s: 1.0 - 1e-5 * s / 40, **eval_at):
    out = []
    for s in range(n):
        r = {"step": s, "loss": loss(s), "pattern": "L0+L1" if s % 4 == 0 else "L0", "compiled": s < 4,
             "step_time_s": (0.2 if s % 4 else 1.7) * (1 + 0.01 * (s % 3))}
        if (s + 1) % 10 == 0:
            r.update({k: f(s) for k, f in eval_at.items()})
        out.append(r)
    return out


def test_a_meanflow_loss_plot_has_no_offset_and_shows_the_error_and_the_energy():
    """The adaptively weighted loss stays within 1e-5 of 1: matplotlib's default labels would read
    "1e-5+9.999e-1". The held-out unweighted error and both energy distances are plotted."""
    recs = records(eval_mse=lambda s: 0.5 / (s + 1), eval_energy_1step=lambda s: 0.3 / (s + 1),
                   eval_energy_multistep=lambda s: 0.2 / (s + 1), eval_sample_steps=lambda s: 4)
    fig = plots.loss_figure(recs, {"eval_mse": 0.01, "eval_energy_1step": 0.02, "eval_energy_multistep": 0.01})
    texts = tick_texts(fig)
    assert not any(("e-" in t or "e+" in t or "×" in t or "$" in t) for t in texts), texts
    assert all(ax.yaxis.get_offset_text().get_text() == "" for ax in fig.axes)
    labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    assert "held-out squared error (unweighted)" in labels
    assert "one-step samples" in labels and "multi-step samples (4 steps)" in labels
    assert legends_outside(fig)


def test_a_text_loss_plot_shows_bits_per_byte_beside_nats():
    recs = records(loss=lambda s: 5.5 - 0.05 * s, eval_loss=lambda s: 5.0 - 0.04 * s)
    per_nat = 1.0 / np.log(2)  # bytes: a token is a byte
    fig = plots.loss_figure(recs, {"eval_loss": 3.4, "eval_bpb": 3.4 * per_nat}, per_nat)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "loss (nats per token)"
    right = [c for c in ax.child_axes if c.get_ylabel() == "bits per byte"]
    assert right, "no bits-per-byte axis"
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    # the right axis maps nats to bits per byte
    assert right[0].get_ylim() == pytest.approx((lo * per_nat, hi * per_nat))
    assert legends_outside(fig)


@pytest.mark.parametrize("fast, slow", [(0.2, 1.7), (0.2, 40.0)])
def test_step_time_axis_is_plain(fast, slow):
    """A narrow range stays linear, a wide one is a log axis; both in plain numbers ("1700", not
    "1.7x10^3"), the legend outside."""
    recs = records()
    for r in recs:
        r["step_time_s"] = slow if r["pattern"] == "L0+L1" else fast
    fig = plots.step_time_figure(recs, {"L0": {"step_time_ms": fast * 1e3}, "L0+L1": {"step_time_ms": slow * 1e3}})
    assert fig.axes[0].get_yscale() == ("log" if slow / fast > 20 else "linear")
    texts = [t for t in tick_texts(fig) if t]
    assert texts and not any(("×" in t or "$" in t or "e+" in t) for t in texts), texts
    assert legends_outside(fig)


def test_plots_are_written(tmp_path):
    recs = records(loss=lambda s: 5.0 - 0.01 * s, eval_loss=lambda s: 4.0)
    assert plots.write(tmp_path, recs, {}, {"eval_loss": 3.9}, 1.4427) == ["loss.png", "step_time.png"]
    assert all((tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in ("loss.png", "step_time.png"))
    assert plots.write(tmp_path / "none", [], {}) == []


def test_sample_grids_are_titled_and_labelled(tmp_path, monkeypatch):
    """write_samples titles the halves (one step; multi-step with its step count) and writes each
    image's class; the 2-D toy's scatter says which points are samples."""
    import matplotlib.figure

    seen = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (seen.append(fig), real(fig, *a, **k))[1])
    rng = np.random.default_rng(0)
    imgs = rng.uniform(-1, 1, (10, 8, 8, 1)).astype(np.float32)
    figures.write_samples(tmp_path / "s.png", imgs, imgs, imgs, 4, np.arange(10) % 3, "after 100 steps")
    texts = [t.get_text() for ax in seen[0].axes for t in ax.texts]
    titles = [ax.get_title() for ax in seen[0].axes]
    assert titles == ["one step (1 network evaluation)", "multi-step (4 steps)"]
    assert texts.count("0") == 2 * 4 and texts.count("2") == 2 * 3  # each half: classes 0,1,2,0,1,2,...
    assert "the number in each corner: the class the sample was drawn for" in [t.get_text() for t in seen[0].texts]
    # a folder's classes: the caption names those drawn (0 ant, 1 bee, 2 cat), in label order
    figures.write_samples(tmp_path / "n.png", imgs[:5], imgs[:5], imgs[:5], 4, np.array([2, 0, 2, 0, 2]), "",
                          ("ant", "bee", "cat"))
    assert "the number in each corner: the class the sample was drawn for (0 ant, 2 cat)" in [
        t.get_text() for t in seen[1].texts]
    pts = rng.normal(size=(50, 1, 1, 2)).astype(np.float32)
    figures.write_samples(tmp_path / "t.png", pts, pts, pts, 2)
    assert "black: samples; grey: held-out points" in [t.get_text() for t in seen[2].texts]
    assert tuple(seen[2].get_size_inches()) == pytest.approx((6.4, 3.8))  # the toy's two squares of 3.2 inches, and a caption
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_class_names_the_font_lacks_draw_without_warnings(tmp_path):
    """A folder's classes named in a script DejaVu Sans lacks (日本, 猫): matplotlib warned of each
    missing character in two lines naming nljax's figures.py, at every evaluation's grid."""
    import warnings

    imgs = np.zeros((4, 8, 8, 3), np.float32)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        figures.write_samples(tmp_path / "cjk.png", imgs, imgs, imgs, 4, np.array([0, 1, 0, 1]), "", ("日本", "猫"))
    assert [str(w.message) for w in said] == [] and (tmp_path / "cjk.png").read_bytes()[:4] == b"\x89PNG"


def test_a_grid_cut_short_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """A write of the grid that fails part-way (a full disk, Ctrl-C) left a partial PNG, which the
    next nljax.generate refused to replace (it lacks the mark of one nljax wrote): written beside
    it and renamed into place, the earlier grid stays whole, no temporary file is left, and the
    error names the file asked for."""
    import errno

    import matplotlib.figure

    imgs = np.zeros((4, 8, 8, 1), np.float32)
    path = tmp_path / "grid.png"
    figures.write_samples(path, imgs, imgs, imgs, 4)
    before = path.read_bytes()

    def full(fig, fname, **kw):
        open(fname, "wb").write(before[:100])
        raise OSError(errno.ENOSPC, "No space left on device", str(fname))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    with pytest.raises(OSError) as e:
        figures.write_samples(path, imgs + 1, imgs, imgs, 4)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    assert path.read_bytes() == before and figures.written_by_nljax(path) and sorted(tmp_path.iterdir()) == [path]


def test_drawing_leaves_the_processs_matplotlib_backend_and_pyplot_alone(tmp_path):
    """A notebook that trained (loss.png, step_time.png drawn) or sampled a MeanFlow grid keeps
    its own matplotlib backend: `matplotlib.use("Agg")` as nljax drew switched it, and the
    notebook's own plots showed no more; pyplot's figures are the user's alone."""
    import subprocess
    import sys

    from helpers import subprocess_env

    code = f"""
import matplotlib, numpy as np, pathlib
matplotlib.use("svg")  # the user's (a notebook's: its inline backend)
import matplotlib.pyplot as plt
from nljax.measure import figures, plots
records = [{{"step": s, "loss": 3.0 - s / 10, "pattern": "L0", "step_time_s": 0.01, "compiled": False}}
           for s in range(4)]
plots.write({str(tmp_path)!r}, records, {{}}, {{"eval_loss": 2.4}}, 1.44)
imgs = np.zeros((4, 8, 8, 1), np.float32)
figures.write_samples(pathlib.Path({str(tmp_path / "s.png")!r}), imgs, imgs, imgs, 2)
print(matplotlib.get_backend(), plt.get_fignums())
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["svg", "[]"]
    assert {f.name for f in tmp_path.iterdir()} == {"loss.png", "step_time.png", "s.png"}
