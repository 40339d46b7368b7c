#!/usr/bin/env bash
# Downloads titans-pytorch 0.5.5 and the packages it needs beyond torch (with its own
# dependencies) and numpy, as wheels for a GPU machine (Python 3.12, Linux x86_64), into .whl/,
# on a machine that has network access. For a GPU machine without it: copy .whl/ there with the
# checkout (scp, rsync, a shared file system, a container image, whatever your cluster uses);
# benchmarks/gpu_suite.sh then installs them from that folder alone
# (`pip install --no-index --find-links .whl titans-pytorch==0.5.5`).
#
#   benchmarks/fetch_wheels.sh [PYTHON_VERSION]      (default 3.12: the GPU machine's Python)
#
# The list is titans-pytorch's dependency closure minus torch's, pinned to the versions the
# side-by-side was measured with (pip freeze of the bench extra's environment).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PKGS=(titans-pytorch==0.5.5 accelerated-scan==0.3.1 assoc-scan==0.0.6 axial-positional-embedding==0.3.12
      cloudpickle==3.1.3 einops==0.8.2 einx==0.4.3 frozendict==2.5.1 hyper-connections==0.4.11 loguru==0.7.3
      ninja==1.13.2 pyvers==0.2.3 rotary-embedding-torch==0.9.1 tensordict==0.15.3 torch-einops-utils==0.2.0
      tqdm==4.70.1 x-transformers==2.31.10)
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYV" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${PKGS[@]}"
du -sh .whl
