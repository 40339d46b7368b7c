#!/usr/bin/env bash
# Bytes per step of flat vs hierarchical reduction and of both frozen-gradient modes, read from
# the compiled HLO on 8 emulated devices (mesh 2 x 4), next to a DDP baseline.
set -euo pipefail
for reduce in flat hierarchical; do
  for frozen in accumulate skip; do
    python -m nljax.comm --cpu-devices 8 mesh.inter=2 sync.reduce=$reduce cms.frozen_grads=$frozen "$@"
    echo
  done
done
