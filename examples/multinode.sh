#!/usr/bin/env bash
# Multi-node training without a cluster manager: run this on every node with its own rank.
#   node 0 (10.0.0.1):  examples/multinode.sh 10.0.0.1:12355 2 0 [key=value ...]
#   node 1:             examples/multinode.sh 10.0.0.1:12355 2 1 [key=value ...]
# Process 0 hosts JAX's coordination service at the given address (reachable from every node);
# each process drives all GPUs of its node; `inter` spans the nodes, `intra` each node's GPUs.
# The same flags can come from NLJAX_COORDINATOR, NLJAX_NUM_PROCESSES and NLJAX_PROCESS_ID.
# If a node dies, the others stop within distributed.timeout_s instead of hanging.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 COORDINATOR_HOST:PORT NUM_NODES NODE_RANK [key=value ...]" >&2
  exit 2
fi
coordinator=$1 nodes=$2 rank=$3
shift 3
exec python -u -m nljax.train \
  --coordinator "$coordinator" --num-processes "$nodes" --process-id "$rank" \
  --config nl_gpu run.dir=runs/multinode "$@"
