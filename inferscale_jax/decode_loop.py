"""Multi-step decode: ``N`` decode steps in one jitted device loop (``EngineConfig.decode_steps``).

A pure decode step (every row one token, no prefill chunk waiting) is the engine's most common
step once prompts are in.  Run one at a time, each costs the host a schedule, a pack, a dispatch,
a read-back and an update; ``_decode_loop`` runs up to ``steps`` of them inside one executable
(a ``lax.fori_loop`` around the model and the sampler), so the host's per-step work is paid once
per ``steps`` tokens of every row.

Iteration ``i`` of the loop, for each row:

1. Its token is the one iteration ``i - 1`` sampled (iteration 0: the row's own token, or the
   previous step's sample fed on the device as in any overlapped step).  Its position is the
   row's start + ``i``; its K/V slot is read from the row's page table on the device (the
   scheduler gave the row pages for the positions its budget writes, ahead of the dispatch), and
   its ``kv_len`` grows by one per iteration (a done row's past its table reads the null page).
   Cascade groups stay as planned: their shared pages are read-only and every row writes past
   them.
2. The model runs one decode step over all rows; the sampler samples with the row's key folded
   with its generated-token index + ``i``, exactly what a single step at that index would use,
   so greedy and sampled outputs equal single-step decoding token for token.
3. The stop checks run on the device: a row whose sampled id is one of its stop ids (EOS unless
   ``ignore_eos``, and ``stop_token_ids``), or that sampled its budget (``max_tokens`` left, at
   most ``steps``), is *done*: later iterations write its K/V into the null page and report no
   token for it (-1).  The loop still runs all ``steps`` iterations: a fixed trip count lets
   XLA run it without reading a predicate back to the host between iterations, which an early
   exit (``lax.while_loop`` on "every row done") would need, holding the host for the loop's
   device time as a traced ``lax.cond`` would (sampling.py).  So the scheduler runs a loop only
   when some row can use all of it (``Scheduler._loop_steps``: a row's budget >= ``steps``);
   iterations after every row stopped on a stop id are the cost, bounded by ``steps - 1``.

The host reads all iterations' samples back in one copy (``[steps, R, 2 + 2n]``, each row as
``runner._sample_rows`` packs it) and the scheduler applies them in order, row by row, with the
same per-token checks as single steps (``Scheduler._apply_loop``): stop strings are found there,
and a row the host ends early (a stop string) had its later tokens computed for nothing.  The
ids of the rows' last tokens come back as a device array as well, so the next step can be fed
them on the device (overlap) while the host applies this one.

Rows that need the host between tokens never run in a loop: grammar masks, penalties, ``min_p``
and logit biases (their ids or masks change per token), and the scheduler plans a single step
whenever prefill work or a waiting request would otherwise wait ``steps`` tokens
(``Scheduler._loop_steps``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from inferscale_jax.buckets import StepKey
from inferscale_jax.kv_cache import AttnMeta, PagedKVCache
from inferscale_jax.sampling import sample_tokens
from models import ModelConfig, forward
from pallas_kernels import common


def stop_width(n: int) -> int:
    """Width of a loop step's stop-id array: a power of 4 >= 4 (few compiled variants)."""
    w = 4
    while w < n:
        w *= 4
    return w


def pack_stops(stops: list[tuple[frozenset, int]], rows: int) -> np.ndarray:
    """``[rows, W + 1]`` int32 for ``_decode_loop``: each row's stop ids (-1 padded) and its
    budget (the most tokens it may sample in this step; padding rows 0, done at once)."""
    w = stop_width(max((len(ids) for ids, _ in stops), default=0))
    out = np.full((rows, w + 1), -1, np.int32)
    out[:, w] = 0
    for i, (ids, budget) in enumerate(stops):
        out[i, :len(ids)] = sorted(ids)
        out[i, w] = budget
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "key", "steps", "size", "precision", "filtered"),
                   donate_argnames=("cache",))
def _decode_loop(params, cache: PagedKVCache, ints, floats, shared, stops, *, cfg: ModelConfig,
                 key: StepKey, steps: int, size: int, precision: str | None = None, filtered: bool = False):
    """``steps`` decode steps over one decode bucket (module docstring).  ``ints``,
    ``floats`` and ``shared`` as ``runner._model_step`` reads them; ``stops`` from ``pack_stops``.
    Returns (packed samples ``[steps, R, 2 + 2n]`` float32, token column -1 where a row sampled
    nothing; the rows' last sampled ids ``[size]`` int32, zero-padded; cache)."""
    assert not key.ragged and key.tokens == key.rows, "a decode loop runs decode buckets only"
    b, w, s = key.rows, key.width, cache.page_size
    tokens, positions, slots = ints[:b], ints[b:2 * b], ints[2 * b:3 * b]
    per_row = ints[3 * b:].reshape(b, w + 8)
    table, kv0, top_k, step0 = per_row[:, :w], per_row[:, w + 1], per_row[:, w + 2], per_row[:, w + 3]
    row_keys = jax.lax.bitcast_convert_type(per_row[:, w + 4:w + 6], jnp.uint32)
    last = per_row[:, w + 7]  # a decode row's flat token index (its own row)
    stop_ids, budget = stops[:, :-1], stops[:, -1]
    meta = AttnMeta(slots=slots, page_table=table, q_lens=per_row[:, w], kv_lens=kv0)
    if shared is not None:  # the cascade group table, as _model_step reads it
        g, ps = key.groups, key.shared
        meta = dataclasses.replace(meta, group_pages=shared[:g * ps].reshape(g, ps),
                                   group_lens=shared[g * ps:g * ps + g], row_group=shared[g * ps + g:])
    cols = 2 + 2 * key.num_logprobs
    as_f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
    out0 = jnp.zeros((steps, b, cols), jnp.float32).at[:, :, 0].set(as_f32(jnp.int32(-1)))
    rows = jnp.arange(b)

    def iteration(i, carry):
        cache, tok, done, out = carry
        off = kv0 - 1 + i  # the new token's index in the row's own pages (past a group's shared ones)
        slot = table[rows, jnp.minimum(off // s, w - 1)] * s + off % s
        step_meta = dataclasses.replace(meta, slots=slots.at[last].set(jnp.where(done, 0, slot)),
                                        kv_lens=kv0 + i)
        logits, cache = forward(params, cfg, tokens.at[last].set(tok)[None], (positions + i)[None], cache,
                                step_meta, last[None], precision=precision)
        t, lp, top_ids, top_lp = sample_tokens(logits[0], floats[:, 0], top_k, floats[:, 1], row_keys,
                                               step0 + i, key.num_logprobs, None, filtered, None,
                                               draw=common.sampler_draw())
        packed = jnp.concatenate([as_f32(jnp.where(done, -1, t))[:, None], lp[:, None], as_f32(top_ids), top_lp],
                                 axis=1)
        out = jax.lax.dynamic_update_index_in_dim(out, packed, i, 0)
        hit = jnp.any(t[:, None] == stop_ids, axis=1)
        return cache, jnp.where(done, tok, t), done | hit | (i + 1 >= budget), out

    init = (cache, tokens[last], budget <= 0, out0)
    cache, tok, _, out = jax.lax.fori_loop(0, steps, iteration, init)
    return out, jnp.zeros((size,), jnp.int32).at[:b].set(tok), cache
