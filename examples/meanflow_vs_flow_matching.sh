#!/usr/bin/env bash
# MeanFlow vs flow matching on the default image set (scikit-learn digits), same model, same
# steps, same data order: prints the energy distance of one-step and multi-step samples to the
# held-out digits (lower is better). Extra arguments are config overrides for both runs, e.g.
#   examples/meanflow_vs_flow_matching.sh train.steps=300 --cpu-devices 2
set -euo pipefail
out=${OUT:-runs/mf_vs_fm}
for loss in meanflow flow_matching; do
  # each run is --quiet (its progress would bury the comparison): say which one is training, else
  # minutes pass without a line
  echo "meanflow_vs_flow_matching.sh: training with meanflow.loss=$loss into $out/$loss ..." >&2
  python -m nljax.train --quiet --config meanflow_digits "run.dir=$out/$loss" run.overwrite=true \
    "meanflow.loss=$loss" "$@"
done
python - "$out" <<'PY'
import json, sys
for loss in ("meanflow", "flow_matching"):
    s = json.load(open(f"{sys.argv[1]}/{loss}/summary.json"))
    print(f"{loss:14s} energy distance: 1-step {s['eval_energy_1step']:.4f}  "
          f"{s['eval_sample_steps']}-step {s['eval_energy_multistep']:.4f}  ({s['steps']} steps)")
PY
