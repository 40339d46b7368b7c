"""A MeanFlow run's evaluation carries what shows its fit (its adaptively weighted loss is about 1
at every step with the default weight): the held-out squared error without the weight
(`eval_mse`), the same on 1 and 4 devices and equal to the model's own per-example error, beside
both energy distances; the sample PNG is written."""

import jax
import numpy as np
import pytest
from helpers import make

DIT = ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
       "model.dit.patch_size=1", "images.source=moons", "images.toy_points=200", "cms.periods=[1]",
       "train.batch_size=8", "meanflow.eval_samples=10", "meanflow.sample_steps=2", "meanflow.adaptive_p=1.0"]


@pytest.mark.slow  # a minute of MeanFlow training on two meshes
def test_the_evaluation_carries_the_unweighted_error_and_the_energy_distances(tmp_path):
    one = make([*DIT, f"run.dir={tmp_path / 'one'}"], 1, 1)
    four = make([*DIT, f"run.dir={tmp_path / 'four'}"], 1, 4)
    got = one.run.evaluate(one.state.params, 7)
    assert {"eval_mse", "eval_energy_1step", "eval_energy_multistep"} <= got.keys()
    assert (tmp_path / "one" / "samples_000007.png").read_bytes()[:4] == b"\x89PNG"
    # the model's own unweighted error, on one device, over the 10 held-out points spread over them
    # that the evaluation draws for (`ImageTask.chosen`), each keyed by its position
    model, data, held = one.engine.model, one.task.data, one.task.chosen(10)
    assert len(held) == 10 and held[-1] > 10  # spread, not the first 10
    batch = {"image": data.eval_x[held], "label": data.eval_y[held].astype(np.int32), "index": held.astype(np.int32)}
    params = jax.device_get(one.state.params)
    want = float(np.mean(model.per_example_error(params, batch)))
    assert got["eval_mse"] == pytest.approx(want, rel=1e-5) and got["eval_mse"] > 0
    # what the weight hides: the weighted loss of the same examples is about 1 whatever the fit
    assert float(np.mean(model.per_example_loss(params, batch))) == pytest.approx(1.0, abs=0.05)
    # the same on 4 devices (rows split, 10 padded to 12 and masked)
    assert four.run.evaluate(four.state.params, 7)["eval_mse"] == pytest.approx(got["eval_mse"], rel=1e-5)
