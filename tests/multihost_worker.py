"""Test helper: `python -m nljax.train` in this process, reporting which stream rows it built.

Run by tests/test_multihost.py under `python -m nljax.launch`; prints one line
`rows built: [...]` (sorted global row indices) after training.
"""

import json
import sys

import numpy as np

from nljax import train
from nljax.data.text import ContextStream

built: set[int] = set()
GLOBAL_ROWS = 8  # train.batch_size of tests/test_multihost.py
_rows_at = ContextStream.rows_at


def rows_at(self, step, rows):
    # Only the run's global training stream: the throughput report's compute-only timing builds a
    # separate 1-device stream of its own, and the streaming evaluation's HeldOutStream (a
    # subclass) builds its small batches whole on the host, like the fresh evaluation.
    if self.rows == GLOBAL_ROWS and type(self) is ContextStream:
        built.update(int(r) for r in np.arange(self.rows)[rows])
    return _rows_at(self, step, rows)


ContextStream.rows_at = rows_at

if __name__ == "__main__":
    code = train.main(sys.argv[1:])
    print(f"rows built: {json.dumps(sorted(built))}", flush=True)
    sys.exit(code)
