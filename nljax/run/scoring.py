"""Many independent text streams read at once by a trained language model: the log-probability of
every token, and the continuation of each stream token by token. The library behind the
lm-evaluation-harness model (nljax/run/harness.py) and `nljax.generate prompts=`
(nljax/run/sampling.py: `completions`).

Each row of a batch is one stream (one request of the harness), read as training reads a row of
its ContextStream: in windows of `train.seq_len` tokens from the stream's first token, attention
inside a window, the neural memory written by each window and carried to the next. A stream
starts from the model's fresh memory; a window that holds a document's end (`end_id`) resets the
memory before the next window, as in training, except for the stream's first token: a leading end
token (the harness's prefix, "a document starts here") is the reset that the fresh start made
already (`generate(..., lead_end_resets=True)` reads it as any other end token, as `TextSampler`
does: the prompts of `nljax.generate`). A stream longer than one window is read whole, never cut:
its earlier windows reach the later ones through the memory, as in the streaming evaluation
(`eval_bpb_stream`).

Rows are split over the mesh's data axes, the parameters whole over them (split over `model`
under tensor parallelism: XLA partitions the model's forward to match, as for `TextSampler`).
Every batch is padded to the same row count and every window to `seq_len` tokens, so one
compiled program serves every call. What comes back to the host (per-token log-probabilities and
argmax, the logits at one position per row) is replicated and each process reads its own copy,
so the reader also runs on a mesh that spans processes (the trainer's `eval.harness_tasks`). A
row's numbers depend on its own tokens only: not on the other rows, the padding or the device
count (the model is causal and its memory is per row).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nljax.models.registry import checked_logits
from nljax.parallel.hostdev import put, replica
from nljax.parallel.mesh import data_size, replicated, rows_sharding

# pick(logits [V] float32, stream index) -> the next token; stop(stream index, its new tokens) -> done
Pick = Callable[[np.ndarray, int], int]
Stop = Callable[[int, list], bool]


class StreamReader:
    """Reads batches of `rows` streams (rounded up to a multiple of the mesh's data-parallel
    devices) with `model` and `params` (the parameter tree whole over the data axes of `mesh`);
    `vocab`: the run's model.vocab_size, which the model's logits must cover (`checked_logits`)."""

    def __init__(self, model, params, mesh, seq_len: int, end_id: int | None, rows: int, *, vocab: int):
        n = data_size(mesh)
        self.rows = -(-max(rows, 1) // n) * n
        self.devices = n  # what `rows` was rounded up to a multiple of (nljax.generate says so)
        self.params, self.t, self.end_id = params, seq_len, end_id
        self.split, rep = rows_sharding(mesh), replicated(mesh)

        def window(params, memory, tokens, reset):  # tokens [R, T+1], reset [R]
            logits, memory = checked_logits(model, params, memory, {"tokens": tokens, "reset": reset}, vocab=vocab)
            logits = logits.astype(jnp.float32)  # [R, T, V]
            logp = jax.nn.log_softmax(logits, axis=-1)
            target = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]  # [R, T]
            greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R, T]
            return jax.lax.with_sharding_constraint((target, greedy), rep), memory

        def next_logits(params, memory, tokens, reset, pos):  # generation: the logits at pos alone
            logits, memory = checked_logits(model, params, memory, {"tokens": tokens, "reset": reset}, vocab=vocab)
            at = jnp.take_along_axis(logits.astype(jnp.float32), pos[:, None, None], axis=1)[:, 0]  # [R, V]
            return jax.lax.with_sharding_constraint(at, rep), memory

        self._window = jax.jit(window)
        # generation reads one position a row: `window`'s log-softmax and argmax over [R, T, V],
        # gathered onto every device, would be computed and moved for every token and never read
        self._next = jax.jit(next_logits)
        self._memory0 = jax.jit(lambda: model.init_memory(self.rows), out_shardings=self.split)
        # a row's memory moves on only where `commit` says so (generation: rows fill windows at different times)
        self._keep = jax.jit(lambda commit, new, old: jax.tree.map(
            lambda a, b: jnp.where(commit.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old))

    def forward(self, memory, tokens: np.ndarray, reset: np.ndarray):
        """One window of every row: ((log-probability of each target [R, T], argmax [R, T]), the
        memory after the window). `tokens` [R, T+1]: T inputs and the last column a target, as
        training's windows."""
        return self._window(self.params, memory, *self._rows(tokens, reset))

    def logits_at(self, memory, tokens: np.ndarray, reset: np.ndarray, pos: np.ndarray):
        """One window of every row, as `forward` reads it: (the logits at `pos` [R, V], the memory
        after the window)."""
        return self._next(self.params, memory, *self._rows(tokens, reset, pos))

    def _rows(self, tokens: np.ndarray, reset: np.ndarray, pos: np.ndarray | None = None) -> tuple:
        """A window's host arrays (tokens int32, reset bool, positions int32) split over the rows."""
        arrays = (np.asarray(tokens, np.int32), np.asarray(reset, bool),
                  *(() if pos is None else (np.asarray(pos, np.int32),)))
        return tuple(put(a, self.split) for a in arrays)

    def _ends(self, inputs: np.ndarray, first: np.ndarray) -> np.ndarray:
        """Whether each row's window `inputs` [R, <=T] holds a document's end, the stream's first
        token left out where `first` [R] (the window starts the stream): the next window's reset."""
        if self.end_id is None:
            return np.zeros(len(inputs), bool)
        hit = inputs == self.end_id
        hit[first, :1] = False
        return hit.any(axis=1)

    def score(self, streams: Sequence[Sequence[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each stream of n tokens: (log-probability of its tokens 1..n-1, each given the
        tokens before it, float64 [n-1]; whether each is the model's most likely token, bool
        [n-1]). Streams are batched by length (longest first), each batch read in lockstep."""
        return self._longest_first(streams, lambda which: self._score_batch([streams[j] for j in which]))

    def _longest_first(self, items: Sequence[Sequence[int]], run: Callable[[list[int]], list]) -> list:
        """`run(indices)` on batches of up to `rows` of `items`' indices, longest items first (a
        batch's windows are its longest item's); the results in `items`' order."""
        order = sorted(range(len(items)), key=lambda i: -len(items[i]))
        out: list = [None] * len(items)
        for i in range(0, len(order), self.rows):
            which = order[i : i + self.rows]
            for j, result in zip(which, run(which)):
                out[j] = result
        return out

    def _score_batch(self, streams: list) -> list[tuple[np.ndarray, np.ndarray]]:
        r, t = self.rows, self.t
        lengths = [len(s) for s in streams]
        windows = max(1, math.ceil((max(lengths) - 1) / t))
        tokens = np.zeros((r, windows * t + 1), np.int32)  # padding rows and tails: never read back
        for b, s in enumerate(streams):
            tokens[b, : len(s)] = s
        memory, reset, first = self._memory0(), np.ones(r, bool), np.ones(r, bool)
        parts = []
        for k in range(windows):
            window = tokens[:, k * t : k * t + t + 1]
            (target, greedy), memory = self.forward(memory, window, reset)
            parts.append((target, greedy))  # read back after the last window: no wait per window
            reset, first = self._ends(window[:, :t], first), np.zeros(r, bool)
        logp = np.concatenate([replica(p) for p, _ in parts], axis=1).astype(np.float64)
        hits = np.concatenate([replica(g) for _, g in parts], axis=1) == tokens[:, 1:]
        return [(logp[b, : max(n - 1, 0)], hits[b, : max(n - 1, 0)]) for b, n in enumerate(lengths)]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, pick: Pick, stop: Stop,
                 lead_end_resets: bool = False) -> list[list[int]]:
        """The tokens after each prompt (at least one token each), chosen by `pick` from the
        logits of the next position, until `stop` says so or `max_new_tokens` are chosen. As
        `TextSampler.tokens` does for one prompt: full windows go into the memory, each token is
        predicted from the memory of the windows before it and its own window so far. A prompt
        needs a token to predict from (the harness's empty context is the document-end token).
        `lead_end_resets`: a prompt's first token, when it is the document end, resets the memory
        after its window as any other end token does (as `TextSampler.tokens` reads a prompt)."""
        empty = [i for i, p in enumerate(prompts) if not len(p)]
        if empty:
            raise ValueError(f"StreamReader.generate: prompt {empty[0]} is empty: give it a first token")
        return self._longest_first(prompts, lambda which: self._generate_batch(
            [list(prompts[j]) for j in which], max_new_tokens, lambda logits, b: pick(logits, which[b]),
            lambda b, toks: stop(which[b], toks), lead_end_resets))

    def _generate_batch(self, prompts: list, max_new: int, pick: Pick, stop: Stop,
                        lead_end_resets: bool = False) -> list[list[int]]:
        r, t, n = self.rows, self.t, len(prompts)
        pending = prompts + [[0] for _ in range(r - n)]  # each row's window not yet in its memory
        new: list[list[int]] = [[] for _ in range(n)]
        live = np.arange(r) < n if max_new > 0 else np.zeros(r, bool)
        memory, reset = self._memory0(), np.ones(r, bool)
        first = np.full(r, not lead_end_resets)  # the rows whose leading end token is no reset
        while live.any():
            tokens = np.zeros((r, t + 1), np.int32)
            for b, p in enumerate(pending):
                tokens[b, : min(len(p), t)] = p[:t]
            pos = np.array([min(len(p), t) - 1 for p in pending], np.int32)
            predict = live & np.array([len(p) <= t for p in pending])  # else: a full window to write first
            at, after = self.logits_at(memory, tokens, reset, pos)
            if predict.any():
                logits = replica(at)
                for b in np.flatnonzero(predict):
                    token = int(pick(logits[b], int(b)))
                    pending[b].append(token)
                    new[b].append(token)
                    live[b] = len(new[b]) < max_new and not stop(int(b), new[b])
            # a window read whole with tokens after it goes into the memory (this forward read it)
            commit = np.array([len(p) > t for p in pending])
            if commit.any():
                memory = self._keep(put(commit, self.split), after, memory)
                ends = self._ends(tokens[:, :t], first)
                reset, first = np.where(commit, ends, reset), first & ~commit
                pending = [p[t:] if c else p for p, c in zip(pending, commit)]
        return new
