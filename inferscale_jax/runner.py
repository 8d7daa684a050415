"""The model runner: packs sequences into bucketed device steps and runs them jitted.

A *step* computes, for each of ``B`` sequences, a chunk of new tokens (``T == 1`` for decode)
over the sequence's pages, writes their K/V into the page pool, and samples one token from the
last new token's logits.  Everything happens in one jitted function (``_model_step``) that
donates the cache (in-place page updates) and returns only the sampled ids (plus log-probs when
asked), so the host reads back a few bytes per step.

Steps are a flat token batch: prefill chunks and one-token decode rows together, each row with
its own query length (``_model_step``).  Shapes are padded to the buckets of ``buckets.py`` (a
small set derived from the config, so ``Engine.warmup`` can compile all of it) and, only in steps
where a row has a sampling penalty, the generated / prompt id arrays to powers of four >= 16
(``penalty_width``; ``sampling.py`` says why the ids travel per step).  Each new bucket is
logged once and counted in ``compiles`` (after warm-up: ``compiles_after_warmup``, a warning).
Padding tokens write into the null page; padding rows read it.

KV chores: a step plan carries the splices its rows need before they run (``StepPlan.splices``:
the copy-on-write of a partially filled shared page - the splice kernel at shift 0 - and
compose's segment tokens moved to their positions with K re-rotated); ``dispatch`` runs them, all
of the step's in one jitted, donating call, before the step itself, so the runner alone writes the
page pool and in the order the steps need.

Matmul precision: the model's dots run under ``matmul_precision`` (a static argument of the
step, so each precision is its own compile), e.g. "highest" for float32 engines, where JAX's
default would use TF32 on a GPU (``EngineConfig.matmul_precision``, docs/architecture.md).

Every value a row carries has passed ``SamplingParams.validate``; packing clamps ``top_k`` to
the vocab size as well, so no row value can overflow the int32 step inputs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from inferscale_jax.buckets import StepBuckets, StepKey, next_pow2
from inferscale_jax.decode_loop import _decode_loop, pack_stops
from inferscale_jax.errors import EngineFault
from inferscale_jax.kv_cache import AttnMeta, PagedKVCache, splice_fn
from inferscale_jax.page_tables import PageTables
from inferscale_jax.sampling import MAX_LOGPROBS, sample_tokens
from inferscale_jax.structured import token_masks
from inferscale_jax.xla_options import step_compiler_options
from models import ModelConfig, forward
from pallas_kernels import common

log = logging.getLogger("inferscale.runner")


def freeze_heap() -> None:
    """Collect, then move every live object out of the cyclic GC's reach (``gc.freeze``).

    The engine keeps a large, long-lived heap (jitted functions, tracing caches, the tokenizer);
    a full collection walks all of it and stalls a decode step (gen-2 passes every few hundred
    steps; the stall measured: bench/NOTES.md, "Figures moved from code comments").  Frozen
    objects are still freed by reference counting; only cycles among them are never collected - so
    the engine's parts never point back at it or at each other in a cycle (a dropped engine is
    freed), and a compile in the middle of serving can pin whatever cyclic garbage exists at that
    moment (bounded by the number of step buckets; warm the buckets before traffic to avoid it).
    Called after engine construction and after each new compile (whose tracing leaves a burst of
    new long-lived objects)."""
    gc.collect()
    gc.freeze()


FILTERED = "top-k/top-p"  # in an executable's key: the sampler sorts the vocabulary (sampling.py)


def penalty_width(n: int) -> int:
    """Width of a penalty step's id array: a power of 4 >= 16, so requests of every length
    share a few compiled variants (a power-of-two ladder let each new length band compile
    again) at up to 4x padding of a few int32 ids per row."""
    w = 16
    while w < n:
        w *= 4
    return w


@dataclasses.dataclass(frozen=True)
class Splice:
    """A KV chore (``StepPlan.splices``): the K/V of token slots ``src[i]`` -> ``dst[i]`` (slot =
    page * page_size + offset) in every layer, K re-rotated by ``shift[i]`` positions (int32 arrays)."""
    src: np.ndarray
    dst: np.ndarray
    shift: np.ndarray


def page_copy(src: list[int], dst: list[int], page_size: int, upto: int) -> Splice:
    """Pages ``src[i]`` -> ``dst[i]``, unrotated, their first ``upto`` slots: the copy-on-write of a
    shared partial page copies the positions before the fork only (its new owner computes the rest,
    so no other chore of the step writes those slots)."""
    off = np.arange(upto, dtype=np.int32)
    src_slots = (np.asarray(src, np.int32)[:, None] * page_size + off).reshape(-1)
    dst_slots = (np.asarray(dst, np.int32)[:, None] * page_size + off).reshape(-1)
    return Splice(src_slots, dst_slots, np.zeros_like(src_slots))


@dataclasses.dataclass(slots=True)
class StepRow:
    """One sequence's part of a step."""
    tokens: list[int]  # new tokens to compute
    start: int  # absolute position of tokens[0] (= tokens already in pages)
    pages: list[int]  # the sequence's pages, covering at least start + len(tokens) positions
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    key: np.ndarray | None = None  # [2] uint32 request key
    sample_step: int = 0  # index of the token being sampled (folded into the key)
    group: int = -1  # cascade: the row's group in StepPlan.groups (its first pages are shared); -1: none
    slot: int = -1  # the request's row in the runner's page tables (page_tables.py); -1: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # read only when a penalty is set: the request's generated ids known to the host (a row fed
    # on the device by an overlapped step gets that fed token added there), and its prompt ids
    # (read when repetition_penalty != 1)
    output_ids: list[int] | None = None
    prompt_ids: list[int] | None = None
    min_p: float = 0.0
    # a sparse logit bias for this step's token (logit_bias, bad words, min_tokens: the scheduler's
    # ``Request.bias``): (token ids, values)
    bias: tuple[list[int], list[float]] | None = None
    # the grammar's matcher of a constrained request whose next token this row samples
    # (structured.py): the step masks the row's logits to the tokens it allows
    matcher: object | None = None

    @property
    def cascade(self) -> bool:
        return self.group >= 0

    @property
    def has_penalty(self) -> bool:
        """Whether the row needs the step's logit processors (penalties, min_p, a bias)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.min_p > 0 or self.bias is not None)


@dataclasses.dataclass
class StepPlan:
    """One device step as plain data, what the scheduler hands the runner: the rows (each a
    sequence's new tokens, start position and page table), the log-prob width to return, the
    cascade groups' shared pages, and which rows feed a token the previous step sampled."""
    rows: list[StepRow]
    num_logprobs: int = 0  # top log-probs per row to return (0: none)
    # cascade: group i's rows (``StepRow.group == i``: one-token rows, and in a mixed step prefill chunks
    # that start past those pages) all start with the same ``groups[i]`` full pages, read once per step
    # for the group (empty: no cascade)
    groups: list[int] = dataclasses.field(default_factory=list)
    # per row: the row of the previous step whose sampled id is this row's token, read on the
    # device (-1: the row's own host token); None: every token comes from the host
    src: list[int] | None = None
    # multi-step decode (decode_loop.py): a decode step run ``steps`` times in one device loop; per
    # row (its stop ids, its budget: the most tokens it samples), every row's pages covering the
    # ``budget`` positions from its start
    steps: int = 1
    stops: list[tuple[frozenset, int]] | None = None
    # KV chores the rows need first (copy-on-write, compose's splices), run before the step in order
    splices: list[Splice] = dataclasses.field(default_factory=list)

    @property
    def shared_pages(self) -> int:
        """The longest group's shared pages (0: no cascade)."""
        return max(self.groups, default=0)


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # [n] int32 sampled ids, one per row
    logprob: np.ndarray  # [n] float32 log-prob of each sampled id
    top_ids: np.ndarray  # [n, k] int32
    top_logprobs: np.ndarray  # [n, k] float32

    @functools.cached_property
    def token_list(self) -> list[int]:
        """``tokens`` as Python ints (one conversion per step, not one per row)."""
        return self.tokens.tolist()


@functools.partial(jax.jit, static_argnames=("cfg", "key", "precision"), donate_argnames=("cache",))
def _model_step(params, cache: PagedKVCache, ints, floats, shared=None, penalties=None, *,
                cfg: ModelConfig, key: StepKey, precision: str | None = None):
    """One step over a flat token batch.  ``ints`` (int32, one host->device copy) is
    ``[tokens N | positions N | slots N | rows R x (W + 8)]`` with each row
    ``[page table W | q_len, kv_len, top_k, sample step, key (2 x uint32 bits), source, last]``
    (``last``: the flat index of the row's last token, whose logits are sampled); ``floats
    [R, 2]`` float32 is (temperature, top_p).  penalties: None, or (gen_ids [R, Wg], prompt_ids
    [R, Wp] int32 (-1: padding), params [R, 4] float32 (presence, frequency, repetition, min_p),
    bias_ids [R, Wb] int32 (-1: padding), bias_vals [R, Wb] float32) when a row of the step has a
    penalty, ``min_p`` or a logit bias (``sampling.apply_penalties``).
    precision: the model's matmul precision (None: JAX's default).
    Returns (packed samples, the rows' logits [R, V] float32, cache).  The samples are greedy: every
    row's argmax (after its penalties) and log-probs, drawing nothing (``sampling.sample_tokens``,
    ``sampled=False``).  The logits are the lm-head matmul's own output (written to memory either
    way); a step with a row of temperature > 0 or a constrained row samples them again in
    ``_sample_step`` (``ModelRunner.sample``: the draw, top-k / top-p, the grammars' masks), so
    sampling options need no variant of this executable (one would compile the whole model again,
    on the engine thread) and an all-greedy step pays no draw (bench/NOTES.md, run BD: the draw is
    ~0.2 ms of a 256-row step)."""
    n, w = key.tokens, key.width
    tokens, positions, slots = ints[:n], ints[n:2 * n], ints[2 * n:3 * n]
    rows = ints[3 * n:].reshape(key.rows, w + 8)
    table, q_lens, kv_lens, last = rows[:, :w], rows[:, w], rows[:, w + 1], rows[:, w + 7]
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    meta = AttnMeta(slots=slots, page_table=table, q_lens=q_lens, kv_lens=kv_lens,
                    cu_q_lens=cu_q_lens if key.ragged else None, ragged=key.ragged)
    if shared is not None:  # cascade: shared = [G * Ps | G | R] int32: group pages, lengths, row groups
        g, ps = key.groups, key.shared
        meta = dataclasses.replace(meta, group_pages=shared[:g * ps].reshape(g, ps),
                                   group_lens=shared[g * ps:g * ps + g], row_group=shared[g * ps + g:])
    logits, cache = forward(params, cfg, tokens[None], positions[None], cache, meta, last[None],
                            precision=precision)
    logits = logits[0]  # [R, V] float32
    return _sample_rows(logits, ints, floats, penalties, None, key, False, sampled=False), logits, cache


def _sample_rows(logits, ints, floats, penalties, token_mask, key: StepKey, filtered: bool, sampled: bool = True):
    """The sampling half of ``_model_step``: [R, 2 + 2n] float32 packed results."""
    n, w = key.tokens, key.width
    tokens = ints[:n]
    rows = ints[3 * n:].reshape(key.rows, w + 8)
    top_k, steps = rows[:, w + 2], rows[:, w + 3]
    row_keys = jax.lax.bitcast_convert_type(rows[:, w + 4:w + 6], jnp.uint32)  # [R, 2]
    src, last = rows[:, w + 6], rows[:, w + 7]
    if penalties is not None:
        gen_ids, prompt_ids, pen, bias_ids, bias_vals = penalties
        # a row fed on the device (source >= 0) has that token, generated by the step before,
        # missing from its host-side ids: add it here
        fed = jnp.where(src >= 0, tokens[last], -1)
        penalties = (jnp.concatenate([gen_ids, fed[:, None]], axis=1), prompt_ids, pen, bias_ids, bias_vals)
    tok, lp, top_ids, top_lp = sample_tokens(logits, floats[:, 0], top_k, floats[:, 1], row_keys, steps,
                                             key.num_logprobs, penalties, filtered, token_mask,
                                             draw=common.sampler_draw(), sampled=sampled)
    as_f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
    # one [R, 2 + 2n] float32 result: a single device->host copy per step
    return jnp.concatenate([as_f32(tok)[:, None], lp[:, None], as_f32(top_ids), top_lp], axis=1)


@functools.partial(jax.jit, static_argnames=("key", "filtered"))
def _sample_step(logits, ints, floats, penalties=None, token_mask=None, *, key: StepKey, filtered: bool = False):
    """A step's sampling again on its logits (``_model_step``'s): the draw of its rows of temperature > 0
    (top-k / top-p with ``filtered``), with its constrained rows' masks (``token_mask``)."""
    return _sample_rows(logits, ints, floats, penalties, token_mask, key, filtered)


def _feed(ints, prev_ids, tokens: int, width: int, rows: int):
    """A row whose source ``j >= 0`` gets the id that row ``j`` of the previous step sampled
    (still on the device) as its (single) token."""
    per_row = ints[3 * tokens:].reshape(rows, width + 8)
    src, last = per_row[:, width + 6], per_row[:, width + 7]
    at = jnp.where(src >= 0, last, ints.shape[0])  # out of range: dropped
    return ints.at[at].set(prev_ids[jnp.maximum(src, 0)], mode="drop")


@functools.partial(jax.jit, static_argnames=("tokens", "width", "rows"))
def _feed_tokens(ints, prev_ids, *, tokens: int, width: int, rows: int):
    """Overlapped steps: ``_feed`` as a jit of its own, never inside ``_model_step``, where the
    select changes XLA's fusion of the embedding lookup (bench/NOTES.md, "Host overhead").
    Its shapes are the step's ``ints`` layout alone (every bucket of the same tokens / width /
    rows shares it)."""
    return _feed(ints, prev_ids, tokens, width, rows)


@functools.partial(jax.jit, donate_argnums=(0,))
def _refill(buf, new):
    """``new`` written into ``buf``'s memory (donated): an input that keeps one device address."""
    return buf.at[:].set(new)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("tokens", "width", "rows"))
def _refill_fed(buf, new, prev_ids, *, tokens: int, width: int, rows: int):
    """``_refill`` of a step's ``ints`` with the overlap's device-fed tokens (``_feed``) in it."""
    return buf.at[:].set(_feed(new, prev_ids, tokens, width, rows))


@functools.partial(jax.jit, static_argnames=("size",))
def _sampled_ids(packed, *, size: int):
    """[size] int32: the sampled ids of a step's packed result (column 0), zero-padded."""
    ids = jax.lax.bitcast_convert_type(packed[:, 0], jnp.int32)
    return jnp.zeros((size,), jnp.int32).at[:ids.shape[0]].set(ids)


@dataclasses.dataclass
class DeferredStep:
    """A dispatched step whose sampling is not done (``ModelRunner.sample`` finishes it): rows that draw
    (temperature > 0), or constrained rows whose masks wait (``dispatch`` with ``defer_sample``).  Its
    greedy samples, its logits and sampling inputs, on the device."""
    packed: jax.Array  # the step's own (greedy) samples (kept when no row draws or needs a mask after all)
    logits: jax.Array  # [B, V] float32
    ints: jax.Array
    floats: jax.Array
    penalties: tuple | None
    rows: list[StepRow]
    key: StepKey
    pen_key: tuple  # the sampler's variant: the model step's, and FILTERED when a drawing row filters
    num_logprobs: int
    drawn: bool = False  # a row has temperature > 0: the greedy samples cannot stand
    constrained: bool = False  # a row has a grammar (``StepRow.matcher``): its mask is made in ``sample``


@dataclasses.dataclass
class PendingStep:
    """A dispatched step whose results are still on the device (``ModelRunner.collect`` reads
    them).  ``sampled_ids()`` gives its sampled ids as a device array for the next step
    (through ``sampler``, the runner's compiled ``_sampled_ids`` for this shape)."""
    packed: jax.Array  # [B, 2 + 2 * nl] float32 on the device
    n: int  # real rows
    nl: int  # padded log-prob width of the bucket
    num_logprobs: int
    size: int  # the runner's max_batch
    sampler: object = None  # packed -> [size] int32 ids (None: the jitted _sampled_ids)
    _ids: jax.Array | None = None
    steps: int = 1  # a decode loop's (decode_loop.py): packed is [steps, B, 2 + 2 * nl], _ids its last ids

    def sampled_ids(self) -> jax.Array:
        if self._ids is None:
            self._ids = (self.sampler(self.packed) if self.sampler is not None
                         else _sampled_ids(self.packed, size=self.size))
        return self._ids


@functools.partial(jax.jit, donate_argnames=("cache",))
def _splice(cache: PagedKVCache, src_slots, dst_slots, shift, inv_freq):
    fn = splice_fn(cache.impl, cache.quantized)  # (compressed KV: dequantize, rotate, quantize again)
    arrays = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if cache.quantized else [])
    if cache.mesh is not None:  # per shard: each device re-rotates its own kv heads' pages
        pages, rep = jax.sharding.PartitionSpec("tp"), jax.sharding.PartitionSpec()
        fn = jax.shard_map(fn, mesh=cache.mesh, in_specs=(pages,) * len(arrays) + (rep,) * 4,
                           out_specs=(pages,) * len(arrays), check_vma=False)
    out = [fn(*layer, src_slots, dst_slots, shift, inv_freq) for layer in zip(*arrays)]
    return cache.with_pages(*[[o[i] for o in out] for i in range(len(arrays))])


class ModelRunner:
    def __init__(self, params: dict, cfg: ModelConfig, cache: PagedKVCache, *, max_batch: int,
                 prefill_chunk: int, max_pages_per_seq: int, inv_freq: np.ndarray,
                 min_table_pages: int = 4, matmul_precision: str | None = None,
                 max_num_batched_tokens: int | None = None):
        """max_num_batched_tokens: new tokens per step (None: max(max_batch, 4 x prefill_chunk));
        matmul_precision: "default" / "high" / "highest" for the model's dots
        (``EngineConfig.resolved_matmul_precision``); None: JAX's default."""
        self.params, self.cfg, self.cache = params, cfg, cache
        self.matmul_precision = matmul_precision
        self.page_size = cache.page_size
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.max_tokens = max_num_batched_tokens or max(max_batch, 4 * prefill_chunk)
        self.max_pages_per_seq = max_pages_per_seq
        self.tables = PageTables(max_batch, max_pages_per_seq)  # running requests' page tables, by slot
        self.buckets = StepBuckets(max_rows=max_batch, max_tokens=self.max_tokens,
                                   max_pages_per_seq=max_pages_per_seq, min_table_pages=min_table_pages,
                                   num_logprobs=MAX_LOGPROBS, narrow_mixed=cache.impl == "ref")
        self.inv_freq = jnp.asarray(inv_freq)
        self.compiled: set[tuple] = set()  # (StepKey, penalty shapes, precision) of every compiled step
        # (StepKey, penalty shapes, matmul precision) -> the step's compiled executable
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        # the overlap helpers' compiled executables: ("feed", tokens, width, rows) -> _feed_tokens,
        # ("ids", rows, columns) -> _sampled_ids (compiled with the steps by ``warmup``)
        self.helpers: dict[tuple, jax.stages.Compiled] = {}
        # The step's inputs are written into persistent device buffers (one per shape, refilled in
        # place by a donated copy), so every step reads them at the same addresses.  On the GPU XLA
        # runs the step as one command buffer (CUDA graph) and must update it on the host when an
        # input's address changes, which left the device idle between steps under load
        # (bench/NOTES.md, run Z).  False: fresh input buffers every step.
        self.stable_inputs = True
        self._staged: dict[tuple, jax.Array] = {}
        self._last: tuple | None = None  # the last step's executable and device inputs (replay_last)
        self.last_key: StepKey | None = None  # the last dispatched step's bucket (benchmarks name what they replay)
        self.compiles = 0
        self.warm = False  # set by Engine.warmup: a compile after it is logged as a warning
        self.compiles_after_warmup = 0
        self.sampler_compiles = 0  # the sampler's own executables compiled on first use (``sample``; not steps)
        self.device = next(iter(cache.k[0].devices()))
        # per-step inputs go here, committed: the device, or replicated over the tensor-parallel mesh
        self.input_sharding = (jax.sharding.SingleDeviceSharding(self.device) if cache.mesh is None
                               else jax.sharding.NamedSharding(cache.mesh, jax.sharding.PartitionSpec()))
        self.fault: EngineFault | None = None  # set when the device failed: nothing more can run
        self.exe_store = None  # compiled steps on disk by bucket (exe_store.py; set by the engine)
        self.compiler_options = step_compiler_options()  # every step's compile (INFERSCALE_GEMM: xla_options.py)
        self.warmup_times: dict = {}  # the last warm-up's parts in seconds (warmup)
        # buckets whose first run the warm-up left for idle time (warmup(first_runs=False)), in order;
        # a bucket leaves when it runs, for real or here (run_first)
        self.first_runs: dict = {}

    def _note_bucket(self, key: tuple) -> bool:
        """Count a new bucket (its step compiles now); True when it is new."""
        if key in self.compiled:
            return False
        self.compiled.add(key)
        self.compiles += 1
        if self.warm:
            self.compiles_after_warmup += 1
            if key[0] in self.warm_skipped:  # a bucket the warm-up set left out on purpose (buckets.py)
                log.info("compiling step for bucket %s on first use (outside the warm-up set; buckets.py)", key)
            else:
                log.warning("compiling a step after warm-up for bucket %s (%d after warm-up); "
                            "docs/architecture.md, 'Compiled steps'", key, self.compiles_after_warmup)
        else:
            log.debug("compiling step for bucket %s (%d buckets so far)", key, self.compiles)
        return True

    def replay_last(self, times: int) -> float:
        """Benchmarks: run the last dispatched step's executable again ``times`` times back to back
        on the same device inputs (the cache chained through, donated), and return the seconds per
        step - the device step without the host's packing.  Each replay writes the same K/V into
        the same slots, so the cache's contents are unchanged."""
        assert self._last is not None, "replay_last needs a dispatched step"
        exe, args = self._last
        t0 = time.perf_counter()
        out = None
        for _ in range(times):
            out, _, self.cache = exe(self.params, self.cache, *args)
        jax.block_until_ready((out, self.cache))
        return (time.perf_counter() - t0) / times

    def check_device(self, err: BaseException) -> None:
        """After ``err`` in a device step: return if the KV cache is still usable, else set
        ``fault`` and raise it (the pages' contents are gone: nothing more can be served)."""
        if self.fault is not None:
            raise self.fault
        try:
            leaves = jax.tree.leaves(self.cache)
            alive = not any(getattr(x, "is_deleted", lambda: False)() for x in leaves)
            if alive:
                jax.block_until_ready(leaves)
        except Exception:  # noqa: BLE001 - a device that cannot even sync is lost
            alive = False
        if alive:
            return
        self.fault = EngineFault(f"the device failed ({type(err).__name__}: {err}) and the KV cache is lost; "
                                 "the engine stopped serving: restart it (segments are restored from the "
                                 "registry and snapshots)")
        raise self.fault from err

    def step(self, rows: list[StepRow], num_logprobs: int = 0, groups: list[int] | None = None,
             splices: list[Splice] | None = None) -> StepResult:
        """Run one device step over ``rows`` (after ``splices``) and wait for its results
        (``dispatch`` + ``collect``)."""
        return self.collect(self.dispatch(StepPlan(rows, num_logprobs, groups or [], splices=splices or [])))

    def collect(self, pending: PendingStep) -> StepResult | list[StepResult]:
        """Read a dispatched step's results back (blocks until the device has computed them); a
        decode loop's (``PendingStep.steps > 1``) as one ``StepResult`` per iteration, whose
        token is -1 for a row that sampled nothing in it (decode_loop.py)."""
        n, nl, k = pending.n, pending.nl, pending.num_logprobs
        packed = np.asarray(jax.device_get(pending.packed))
        if pending.steps > 1:
            return [self._result(p[:n], nl, k) for p in packed]
        return self._result(packed[:n], nl, k)

    @staticmethod
    def _result(packed: np.ndarray, nl: int, k: int) -> StepResult:
        """One step's ``[n, 2 + 2 * nl]`` packed samples as a ``StepResult``."""
        ids = packed.view(np.int32)
        return StepResult(ids[:, 0].copy(), packed[:, 1].copy(), ids[:, 2:2 + k].copy(),
                          packed[:, 2 + nl:2 + nl + k].copy())

    def dispatch(self, plan: StepPlan, prev: PendingStep | None = None,
                 defer_sample: bool = False) -> PendingStep | DeferredStep:
        """Launch one device step (``plan``: rows of 1..prefill_chunk new tokens each, at most
        ``max_num_batched_tokens`` in all); returns at once (the device runs it while the host
        goes on; ``collect`` reads the results).  Rows of one token and prefill chunks mix
        freely: the tokens are laid out flat and attention takes each row's query length
        (``pallas_kernels/ragged_attention.py``); a step whose rows all feed one token is a
        *decode* bucket (decode kernel, cascade).

        ``plan.groups`` (decode and mixed steps; a mixed step's chunk rows may be members too, when
        they start past the shared pages): the rows of group ``i`` all start with the same
        ``groups[i]`` full pages; attention reads each group's pages once for the group's query
        tokens (the multi-group cascade kernel), and every other row reads its whole page list as
        usual.  ``plan.src`` with ``prev``: row ``i`` with ``src[i] = j >= 0`` (a
        one-token row) feeds the id that row ``j`` of the step ``prev`` sampled, read on the
        device (its host token is ignored).

        The model step samples greedily (``_model_step``).  A step with a row of temperature > 0
        is sampled again from its logits (``sample``, a small executable of its own) at once, and
        so are rows with a grammar (``row.matcher``, structured.py), with their masks: at once, or,
        with ``defer_sample``, when the caller calls ``sample`` - a constrained row fed on the
        device needs the token the step before sampled applied to its grammar first, which the
        host does while the device computes this step.

        ``plan.splices`` run first (``run_splices``): the KV the rows read from pages they copied
        or spliced at admission."""
        if plan.splices:
            self.run_splices(plan.splices)
        rows, num_logprobs, groups, src = plan.rows, plan.num_logprobs, plan.groups, plan.src
        assert src is None or (prev is not None and len(src) == len(rows))
        # a decode loop's row writes its budget's positions (decode_loop.py): its table covers them
        ahead = np.fromiter((b for _, b in plan.stops), np.int32, len(rows)) if plan.steps > 1 else 1
        key, pen_key, host = self._pack(rows, num_logprobs, groups, src, ahead)
        if self.first_runs:  # this bucket's first run is this step (warmup, first_runs=False)
            self.first_runs.pop(key, None)
        if plan.steps > 1:
            return self._dispatch_loop(plan, key, pen_key, host, prev)
        ints_d, floats_d, shared, penalties = self._inputs(key, host, prev if src is not None else None)
        model_key = tuple(p for p in pen_key if p != FILTERED)  # (the model step samples greedily)
        exe = self.executables.get((key, model_key, self.matmul_precision))
        if exe is None:
            exe = self._compile(key, model_key, (ints_d, floats_d, shared, penalties))
        packed, logits, self.cache = exe(self.params, self.cache, ints_d, floats_d, shared, penalties)
        self._last, self.last_key = (exe, (ints_d, floats_d, shared, penalties)), key
        constrained = any(r.matcher is not None for r in rows)
        drawn = any(r.temperature > 0 for r in rows)
        if constrained or drawn:
            deferred = DeferredStep(packed, logits, ints_d, floats_d, penalties, rows, key, pen_key, num_logprobs,
                                    drawn, constrained)
            return deferred if defer_sample and constrained else self.sample(deferred)
        sampler = self._helper(("ids", key.rows, 2 + 2 * key.num_logprobs))
        return PendingStep(packed, len(rows), key.num_logprobs, num_logprobs, self.max_batch, sampler)

    def _dispatch_loop(self, plan: StepPlan, key: StepKey, pen_key: tuple, host: tuple,
                       prev: PendingStep | None) -> PendingStep:
        """``dispatch`` of a multi-step decode plan (``plan.steps > 1``; decode_loop.py)."""
        assert not key.ragged and host[3] is None and plan.stops is not None and len(plan.stops) == len(plan.rows), \
            "a decode loop runs plain decode rows (no penalties, bias or grammar), each with its stops"
        assert not any(r.matcher is not None for r in plan.rows)
        stops = pack_stops(plan.stops, key.rows)
        args = self._inputs(key, host[:3] + (stops,), prev if plan.src is not None else None, "stops")
        loop_key = pen_key + (("loop", plan.steps, stops.shape[1], self.max_batch),)  # (ids come back [max_batch])
        exe = self.executables.get((key, loop_key, self.matmul_precision))
        if exe is None:
            exe = self._compile(key, loop_key, args)
        packed, ids, self.cache = exe(self.params, self.cache, *args)
        self._last, self.last_key = (exe, args), key
        return PendingStep(packed, len(plan.rows), key.num_logprobs, plan.num_logprobs, self.max_batch,
                           _ids=ids, steps=plan.steps)

    def _inputs(self, key: StepKey, host: tuple, fed_by: PendingStep | None, last: str = "") -> tuple:
        """A step's host arrays (ints, floats, shared, and a last one: the penalties, or a loop's
        ``last`` = "stops") on the device, with the tokens ``fed_by`` (the step in flight) samples
        fed into ``ints`` on the device; with ``stable_inputs``, in their persistent buffers (the
        penalties, whose widths vary, travel fresh)."""
        ints_d, floats_d, shared, extra = self._to_device(host)
        if self.stable_inputs:
            fed = dict(prev_ids=fed_by.sampled_ids(), tokens=key.tokens, width=key.width,
                       rows=key.rows) if fed_by is not None else None
            ints_d = self._stage(self._feed_key(key), ints_d, fed)
            floats_d = self._stage(("floats", key.rows), floats_d)
            if shared is not None:
                shared = self._stage(("shared",) + shared.shape, shared)
            if last and extra is not None:
                extra = self._stage((last,) + extra.shape, extra)
        elif fed_by is not None:
            ints_d = self._helper(self._feed_key(key))(ints_d, fed_by.sampled_ids())
        return ints_d, floats_d, shared, extra

    def sample(self, step: DeferredStep) -> PendingStep:
        """Sample a deferred step (``dispatch``): its drawing rows from its logits, and its constrained
        rows with their masks, computed now from their matchers as they stand."""
        key = step.key
        sampler = self._helper(("ids", key.rows, 2 + 2 * key.num_logprobs))
        # (a step without grammars skips the pass over its rows for masks)
        mask = self._token_mask(step.rows, key.rows) if step.constrained else None
        if mask is None and not step.drawn:  # every constrained row was ended by its fed token, none draws:
            return PendingStep(step.packed, len(step.rows), key.num_logprobs, step.num_logprobs, self.max_batch,
                               sampler)  # the step's own samples stand
        pen_key, mask_d = step.pen_key, None
        if mask is not None:
            pen_key, mask_d = pen_key + ("mask",), jax.device_put(mask, self.input_sharding)
        hk = self._sample_key(key, pen_key)
        skey = hk[1]
        exe = self.helpers.get(hk)
        if exe is None:  # (small: the sampler alone, compiled on first use or by the warm-up)
            t = time.perf_counter()
            exe = self.helpers[hk] = _sample_step.lower(step.logits, step.ints, step.floats, step.penalties, mask_d,
                                                        key=skey, filtered=FILTERED in pen_key).compile()
            self.sampler_compiles += 1
            log.info("compiled the sampler of bucket %s %s on first use in %.2f s (%d sampler compiles)", skey,
                     pen_key, time.perf_counter() - t, self.sampler_compiles)
        packed = exe(step.logits, step.ints, step.floats, step.penalties, mask_d)
        return PendingStep(packed, len(step.rows), key.num_logprobs, step.num_logprobs, self.max_batch, sampler)

    @staticmethod
    def _sample_key(key: StepKey, pen_key: tuple) -> tuple:
        """The sampler executable's key: it reads the rows' layout (rows, tokens, table width,
        log-probs) and the sampling options, so one serves every cascade / ragged variant of a shape."""
        return ("sample", dataclasses.replace(key, shared=0, groups=0, ragged=False), pen_key)

    def _lower_sampler(self, key: StepKey, logits_sharding):
        """Lower the plain sampler (no penalties, masks or top-k / top-p) of bucket ``key``'s steps
        (the warm-up's: rows of temperature > 0 are sampled here on the first step, compile-free)."""
        on = self.input_sharding
        b, t, w = key.rows, key.tokens, key.width
        shape = lambda s, dt, sh=on: jax.ShapeDtypeStruct(s, dt, sharding=sh)  # noqa: E731
        return _sample_step.lower(shape((b, self.cfg.vocab_size), jnp.float32, logits_sharding),
                                  shape((3 * t + b * (w + 8),), jnp.int32), shape((b, 2), jnp.float32), None, None,
                                  key=self._sample_key(key, ())[1], filtered=False)

    def _token_mask(self, rows: list[StepRow], b: int) -> np.ndarray | None:
        """[b, ceil(V / 32)] allowed-token bits of the constrained rows (structured.py); None: none."""
        constrained = [(r.matcher, i) for i, r in enumerate(rows) if r.matcher is not None]
        return token_masks(constrained, b, self.cfg.vocab_size) if constrained else None

    def _stage(self, name: tuple, new: jax.Array, fed: dict | None = None) -> jax.Array:
        """``new`` (a fresh device copy of a step input) written into the persistent buffer
        ``name`` (``stable_inputs``); ``fed``: the overlap's token feed, applied on the way.  The
        buffer the in-flight step reads is donated: the refill runs after it on the device."""
        buf = self._staged.pop(name, None)
        if buf is None:
            buf = jnp.zeros_like(new)
        out = _refill(buf, new) if fed is None else _refill_fed(buf, new, **fed)
        self._staged[name] = out
        return out

    @staticmethod
    def _feed_key(key: StepKey) -> tuple:
        return ("feed", key.tokens, key.width, key.rows)

    def _lower_helper(self, hk: tuple):
        """Lower an overlap helper for its shapes (``self.helpers``' keys)."""
        on = self.input_sharding
        ids = jax.ShapeDtypeStruct((self.max_batch,), jnp.int32, sharding=on)
        if hk[0] == "feed":
            _, t, w, b = hk
            ints = jax.ShapeDtypeStruct((3 * t + b * (w + 8),), jnp.int32, sharding=on)
            return _feed_tokens.lower(ints, ids, tokens=t, width=w, rows=b)
        _, b, cols = hk
        return _sampled_ids.lower(jax.ShapeDtypeStruct((b, cols), jnp.float32, sharding=on), size=self.max_batch)

    def _helper(self, hk: tuple):
        exe = self.helpers.get(hk)
        if exe is None:
            exe = self.helpers[hk] = self._lower_helper(hk).compile()
        return exe

    def _pack(self, rows: list[StepRow], num_logprobs: int, groups: list[int], src: list[int] | None,
              steps: int | np.ndarray = 1):
        """The step's bucket, its penalty shape key and its host arrays (ints, floats, shared,
        penalties), laid out as ``_model_step`` reads them.  ``steps`` > 1 (one for all rows, or
        per row): a decode loop's (decode_loop.py), whose page tables cover each row's next
        ``steps`` positions.

        Per-row values are gathered with one pass each and written with numpy; the page tables
        of one-token rows with a slot (``StepRow.slot``) come from the persistent ``tables`` in one
        gather, every other row's from its page list."""
        n = len(rows)
        s = self.page_size
        lens = np.fromiter((len(r.tokens) for r in rows), np.int32, n)
        starts = np.fromiter((r.start for r in rows), np.int32, n)
        assert lens.max() <= self.prefill_chunk
        own = np.asarray(groups + [0], np.int32)[np.fromiter((r.group for r in rows), np.int32, n)]  # (-1: 0)
        ends = starts + lens
        his = -(-(ends + steps - 1) // s)  # pages past this step's tokens are not read
        count = his - own  # table entries of each row (its leading ``own`` pages: the group's prefix)
        at = np.cumsum(lens) - lens  # flat index of each row's first token
        total = int(at[-1] + lens[-1])
        key = self.buckets.key(n, total, int(count.max()), num_logprobs, max(groups, default=0), len(groups))
        self.buckets.count(key, n, total)
        b, t, w = key.rows, key.tokens, key.width
        penalties = self._pack_penalties(rows, b) if any(r.has_penalty for r in rows) else None
        pen_key = (("pen",) + penalties[0].shape[1:] + penalties[1].shape[1:] + penalties[3].shape[1:]
                   if penalties is not None else ())
        if any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1.0) for r in rows):
            pen_key = (FILTERED,) + pen_key  # the sampler sorts the vocabulary: a variant of its own

        ints = np.zeros((3 * t + b * (w + 8),), np.int32)
        tokens, positions, slots = ints[:t], ints[t:2 * t], ints[2 * t:3 * t]  # views
        per_row = ints[3 * t:].reshape(b, w + 8)
        table = per_row[:, :w]
        meta = per_row[:, w:]  # q_len, kv_len, top_k, step, key x 2, source, last
        if not key.ragged:  # decode padding rows: one query over one key, both in the null page
            meta[:, 0:2] = 1
            meta[:, 7] = np.arange(b)
        meta[:, 6] = -1  # token source: the host (>= 0: a row of the previous step, on the device)
        if src is not None:
            meta[:n, 6] = src
        meta[:n, 0] = lens
        meta[:n, 1] = ends - own * s
        meta[:n, 2] = np.minimum(np.fromiter((r.top_k for r in rows), np.int64, n), self.cfg.vocab_size)
        meta[:n, 3] = np.fromiter((r.sample_step for r in rows), np.int32, n)
        meta[:n, 7] = at + lens - 1  # the row's last token: its logits are sampled
        zero_key = (0, 0)
        meta[:n, 4:6].view(np.uint32)[:] = [zero_key if r.key is None else r.key for r in rows]
        floats = np.zeros((b, 2), np.float32)
        floats[:, 1] = 1.0  # top_p
        floats[:n] = [(r.temperature, r.top_p) for r in rows]
        # rows from the persistent tables: one-token rows with a slot (decode rows of requests)
        tabled = self.tables
        fast = [i for i, r in enumerate(rows) if r.slot >= 0 and len(r.tokens) == 1]
        if fast:
            sync, written = tabled.sync, tabled.n
            for i in fast:
                r = rows[i]
                if written[r.slot] != len(r.pages):
                    sync(r.slot, r.pages)
            f = np.asarray(fast, np.int32)
            fslots = np.fromiter((rows[i].slot for i in fast), np.int32, len(fast))
            fcount = count[f]
            used = int(fcount.max())  # (a cascade bucket's table is as wide as the longest sequence)
            table[f, :used] = tabled.gather(fslots, own[f], fcount, used)
            fat, pos = at[f], starts[f]
            tokens[fat] = [rows[i].tokens[0] for i in fast]
            positions[fat] = pos
            slots[fat] = tabled.table[fslots, pos // s] * s + pos % s
        if len(fast) < n:  # every other row: from its page list
            is_fast = set(fast)
            for i, r in enumerate(rows):
                if i in is_fast:
                    continue
                m, start, pages, a = int(lens[i]), r.start, r.pages, int(at[i])
                table[i, :count[i]] = pages[int(own[i]):int(his[i])]
                if m == 1:
                    tokens[a], positions[a], slots[a] = r.tokens[0], start, pages[start // s] * s + start % s
                    continue
                pos = np.arange(start, start + m, dtype=np.int32)  # a chunk (in a group: past its shared pages)
                tokens[a:a + m] = r.tokens
                positions[a:a + m] = pos
                slots[a:a + m] = table[i, pos // s - own[i]] * s + pos % s
        # padding tokens (flat index >= total) write into the null slot 0 at position 0
        shared = self._pack_groups(rows, groups, key) if groups else None
        return key, pen_key, (ints, floats, shared, penalties)

    def _pack_groups(self, rows: list[StepRow], groups: list[int], key: StepKey) -> np.ndarray:
        """The group table as ``_model_step`` reads it: ``[G * Ps | G | R]`` int32 = each group's
        shared pages (padding: the null page, past its length), its shared tokens (padding groups:
        0) and each row's group (padding rows: -1)."""
        g, ps, b, s = key.groups, key.shared, key.rows, self.page_size
        shared = np.zeros((g * ps + g + b,), np.int32)
        table = shared[:g * ps].reshape(g, ps)  # [G, Ps] (views)
        lens, row_group = shared[g * ps:g * ps + g], shared[g * ps + g:]
        row_group[:] = -1
        row_group[:len(rows)] = [r.group for r in rows]
        first, last = {}, {}  # group -> its first and last member row
        for r in rows:
            if r.group >= 0:
                first.setdefault(r.group, r)
                last[r.group] = r
        assert len(first) == len(groups), "every cascade group needs a row"  # (scheduler-built groups)
        for i, k in enumerate(groups):
            pages = first[i].pages[:k]
            assert last[i].pages[:k] == pages, "a group's rows must share its first pages"
            table[i, :k] = pages
            lens[i] = k * s
        return shared

    def _to_device(self, host: tuple) -> tuple:
        """The step's host arrays, committed to the runner's device (as the executables expect)."""
        return tuple(None if x is None else jax.device_put(x, self.input_sharding) for x in host)

    def _lower(self, key: StepKey, args: tuple, filtered: bool = False, loop: tuple | None = None):
        """``loop``: a decode loop's ``("loop", steps, stop width, max_batch)`` (its ``args`` end
        with the stops, not the penalties); ``filtered``: its sampler sorts the vocabulary (a model
        step samples greedily: ``_sample_step`` filters)."""
        if loop is not None:
            return _decode_loop.lower(self.params, self.cache, *args, cfg=self.cfg, key=key, steps=loop[1],
                                      size=self.max_batch, precision=self.matmul_precision, filtered=filtered)
        return _model_step.lower(self.params, self.cache, *args, cfg=self.cfg, key=key,
                                 precision=self.matmul_precision)

    def _compile(self, key: StepKey, pen_key: tuple, args: tuple):
        """Compile (or load from the executable store or the persistent cache) the step of one
        bucket, now."""
        full = (key, pen_key, self.matmul_precision)
        self._note_bucket(full)
        exe = self.exe_store.load(full) if self.exe_store is not None else None
        if exe is None:
            loop = next((p for p in pen_key if isinstance(p, tuple) and p[0] == "loop"), None)
            exe = self._lower(key, args, FILTERED in pen_key, loop).compile(compiler_options=self.compiler_options)
            if self.exe_store is not None:
                self.exe_store.save(full, exe)
        self.executables[full] = exe
        freeze_heap()
        return exe

    def _padding_rows(self, key: StepKey) -> list[StepRow] | None:
        """A step of bucket ``key`` on padding only: every token writes the null page, every row
        reads it; None when no step can take this bucket (a token bucket the rows cannot fill
        with chunks of ``prefill_chunk``)."""
        s, chunk = self.page_size, self.prefill_chunk
        groups = self._padding_groups(key)
        if key.ragged:  # key.tokens tokens in chunks of <= prefill_chunk, the first >= 2 tokens, then
            # (cascade) a one-token row for each group
            ones = len(groups)
            rest = key.tokens - ones
            lens = [min(chunk, rest - c) for c in range(0, rest, chunk)] + [1] * ones
            if len(lens) > key.rows or lens[0] < 2:
                return None
        else:
            lens = [1] * key.rows
        rows = [StepRow([0] * m, 0, [0] * -(-m // s)) for m in lens]
        if not key.ragged and not key.shared:  # the first row needs the whole table width
            rows[0].pages, rows[0].start = [0] * key.width, key.width * s - 1
        one_token = [r for r in rows if len(r.tokens) == 1]
        for i, r in enumerate(one_token[len(one_token) - len(groups):]):  # groups of one row over null pages
            r.pages, r.start, r.group = [0] * (key.shared + 1), key.shared * s, i
        need = max(-(-(r.start + len(r.tokens)) // s) - (groups[r.group] if r.group >= 0 else 0) for r in rows)
        if self.buckets.key(len(rows), key.tokens, need, key.num_logprobs, max(groups, default=0),
                            len(groups)) != key:
            return None
        return rows

    def _padding_groups(self, key: StepKey) -> list[int]:
        """The cascade groups of ``_padding_rows(key)``: enough for the bucket's group count (a
        mixed step's: one more than the next smaller warmed group bucket of its rows holds, one with
        ``INFERSCALE_MIXED_GROUPS=max``)."""
        if not key.shared:
            return []
        if key.ragged:
            below = [g for g in self.buckets.mixed_group_buckets(key.rows) if g < key.groups]
            return [key.shared] * (1 + max(below, default=0))
        return [key.shared] * min(key.groups, key.rows)

    # buckets a partial warm-up left out (Engine.warmup sets it): their first compile is expected
    warm_skipped: frozenset = frozenset()

    def warmup(self, keys: list[StepKey], progress=None, workers: int | None = None, stop=None,
               first_runs: bool = True) -> int:
        """Compile (or load from the persistent cache) the steps of ``keys``, several at a time:
        each step is traced and lowered here (Python, one at a time), and XLA compiles it on a
        pool of ``workers`` threads (default: the CPUs, at most 8) while the next one lowers, with
        the overlap helpers of their shapes.  Then, on an accelerator, each bucket runs once on
        padding (its first run sets up what later runs reuse: ~0.1 s a bucket on the H200, 9.5 s
        for 92 buckets, bench/NOTES.md run AM); ``first_runs=False`` leaves those runs to the
        caller's idle time instead (``first_runs`` holds them; ``run_first`` runs one, and a
        bucket's first real step takes it off).  ``progress(done, total)`` after
        each bucket.  ``stop()``, checked between buckets: when true, nothing more is lowered or
        started (the compiles already running finish; XLA cannot interrupt one) and the warm-up
        returns early; an exception (Ctrl-C) likewise starts nothing more before it propagates.
        Returns how many of ``keys`` are ready."""
        stop = stop or (lambda: False)
        plans = [(key, rows) for key in keys if (rows := self._padding_rows(key)) is not None]
        todo = [(key, rows) for key, rows in plans if (key, (), self.matmul_precision) not in self.executables]
        workers = workers or min(8, os.cpu_count() or 1)
        done = len(plans) - len(todo)
        helpers = list(dict.fromkeys(hk for key, _ in plans
                                     for hk in (self._feed_key(key), ("ids", key.rows, 2 + 2 * key.num_logprobs))
                                     if hk not in self.helpers))

        store = self.exe_store
        times = self.warmup_times = dict.fromkeys(("store_s", "lower_s", "compile_wait_s", "first_runs_s"), 0.0)
        samplers: dict = {}  # future -> sampler key: each bucket's plain sampler, compiled beside the steps
        saves: list = []

        def record(fut, key, exe=None) -> None:
            nonlocal done
            full = (key, (), self.matmul_precision)
            self._note_bucket(full)
            if exe is None:
                exe = fut.result()
                if store is not None and pool_open:  # (serializing and checking it on the pool: the warm-up goes on)
                    saves.append(pool.submit(store.save, full, exe))
                elif store is not None:  # (a compile that finished after a stop)
                    store.save(full, exe)
            self.executables[full] = exe
            queue_sampler(key, exe)
            done += 1
            if progress is not None:
                progress(done, len(plans))

        def queue_sampler(key, exe) -> None:
            """The plain sampler of ``key``'s shape (its rows that draw), on the pool: its input is the step's
            logits as the step leaves them (``output_shardings``).  Optional: a failure here leaves it to
            its first use."""
            hk = self._sample_key(key, ())
            if not pool_open or stop() or hk in self.helpers or hk in samplers.values():
                return
            try:
                lowered = self._lower_sampler(key, exe.output_shardings[1])
            except Exception as err:  # noqa: BLE001
                log.warning("warm-up: the sampler of %s did not lower (%s: %s); it compiles on first use",
                            hk[1], type(err).__name__, err)
                return
            samplers[pool.submit(lowered.compile)] = hk

        futures, small, pending, all_done, loads, pool_open = {}, {}, set(), False, {}, True
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="inferscale-compile") as pool:
            try:
                if store is not None and todo:
                    # stored steps load on the pool, several at a time (no tracing: exe_store.py); the
                    # ones not found are traced below
                    t = time.perf_counter()
                    loads = {pool.submit(store.load, (key, (), self.matmul_precision)): (key, rows)
                             for key, rows in todo}
                    missing = []
                    for fut, (key, rows) in loads.items():
                        if stop():
                            break
                        exe = fut.result()
                        if exe is None:
                            missing.append((key, rows))
                        else:
                            record(None, key, exe)
                    todo = missing
                    times["store_s"] = time.perf_counter() - t
                t = time.perf_counter()
                for key, rows in todo:
                    if stop():
                        break
                    _, _, host = self._pack(rows, key.num_logprobs, self._padding_groups(key), None)
                    lowered = self._lower(key, self._to_device(host))
                    futures[pool.submit(lowered.compile, compiler_options=self.compiler_options)] = key
                times["lower_s"] = time.perf_counter() - t
                t = time.perf_counter()
                small = {pool.submit(self._lower_helper(hk).compile): hk for hk in helpers if not stop()}
                pending = set(futures)
                while pending and not stop():
                    finished, pending = concurrent.futures.wait(pending, timeout=0.25,
                                                                return_when=concurrent.futures.FIRST_COMPLETED)
                    for fut in finished:
                        record(fut, futures[fut])
                all_done = not pending and not stop()
                times["compile_wait_s"] = time.perf_counter() - t
            finally:
                if not all_done:  # stopped or raising: cancel what has not started (the pool's exit
                    for fut in (*futures, *small, *loads, *samplers):  # waits for the running ones and the saves:
                        fut.cancel()                          # what compiled is kept)
        pool_open = False
        for fut in pending:
            if not fut.cancelled():
                record(fut, futures[fut])
        for fut, hk in small.items():
            if not fut.cancelled():
                self.helpers[hk] = fut.result()
        for fut, hk in samplers.items():
            if fut.cancelled():
                continue
            try:
                self.helpers[hk] = fut.result()
            except Exception as err:  # noqa: BLE001 - optional: it compiles on first use instead
                log.warning("warm-up: the sampler of %s did not compile (%s: %s); it compiles on first use",
                            hk[1], type(err).__name__, err)
        if stop() or self.device.platform == "cpu":  # (a CPU executable's first run costs what any run does)
            return done
        if not first_runs:
            self.first_runs = {key: rows for key, rows in plans if (key, (), self.matmul_precision) in self.executables}
            return done
        t = time.perf_counter()
        for key, rows in plans:
            if stop():
                break
            jax.block_until_ready(self.dispatch(StepPlan(rows, key.num_logprobs, self._padding_groups(key))).packed)
        times["first_runs_s"] = time.perf_counter() - t
        return done

    def run_first(self) -> bool:
        """The first run of one bucket ``warmup(first_runs=False)`` left (on padding, waited for);
        False when none is left.  Only between steps: nothing may be in flight."""
        if not self.first_runs:
            return False
        key, rows = next(iter(self.first_runs.items()))  # (dispatch takes it off the list)
        b = self.buckets
        counts = (b.real_tokens, b.padded_tokens, b.real_rows, b.padded_rows)  # (padding: not served work)
        jax.block_until_ready(self.dispatch(StepPlan(rows, key.num_logprobs, self._padding_groups(key))).packed)
        b.real_tokens, b.padded_tokens, b.real_rows, b.padded_rows = counts
        self.first_runs.pop(key, None)
        return True

    def warmup_loops(self, keys: list[StepKey], steps: int, stop_ids: frozenset, stop=None,
                     workers: int | None = None) -> int:
        """Compile (or load) the decode loops (decode_loop.py) of ``steps`` iterations for the
        decode buckets among ``keys``, with the stop-id width of ``stop_ids`` (the model's EOS ids:
        what most requests stop on; another width compiles on first use).  Lowered here one at a
        time, compiled on a pool of ``workers`` threads.  Returns how many are ready."""
        stop = stop or (lambda: False)
        s = self.page_size
        jobs = []
        for key in keys:
            rows = None if key.ragged else self._padding_rows(key)
            if rows is None:
                continue
            if not key.shared:  # the widest row ends where its table does, ``steps`` positions on
                rows[0].start = max(0, key.width * s - steps)
            groups = self._padding_groups(key)
            plan = StepPlan(rows, key.num_logprobs, groups, steps=steps, stops=[(stop_ids, 1)] * len(rows))
            got, pen_key, host = self._pack(rows, key.num_logprobs, groups, None, steps)
            if got != key or pen_key:
                continue
            stops = pack_stops(plan.stops, key.rows)
            full = (key, (("loop", steps, stops.shape[1], self.max_batch),), self.matmul_precision)
            if full not in self.executables:
                jobs.append((full, self._to_device(host[:3] + (stops,))))
        done = 0
        with concurrent.futures.ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1),
                                                   thread_name_prefix="inferscale-compile") as pool:
            futures = {}
            for full, args in jobs:
                if stop():
                    break
                self._note_bucket(full)
                exe = self.exe_store.load(full) if self.exe_store is not None else None
                if exe is not None:
                    self.executables[full] = exe
                    done += 1
                    continue
                lowered = self._lower(full[0], args, False, full[1][0])
                futures[pool.submit(lowered.compile, compiler_options=self.compiler_options)] = full
            for fut in concurrent.futures.as_completed(futures):
                full = futures[fut]
                self.executables[full] = exe = fut.result()
                if self.exe_store is not None:
                    self.exe_store.save(full, exe)
                done += 1
        return done

    @staticmethod
    def _pack_penalties(rows: list[StepRow], b: int) -> tuple[np.ndarray, ...]:
        """(gen_ids [b, Wg], prompt_ids [b, Wp] int32, -1 padded; params [b, 4] float32; bias_ids
        [b, Wb] int32, -1 padded; bias_vals [b, Wb] float32) for a step where some row has a
        penalty, ``min_p`` or a bias; rows without one contribute only padding.  Widths are
        ``penalty_width`` buckets (0 when no row needs that part)."""
        pen_rows = [r for r in rows if r.has_penalty]
        counted = [r for r in pen_rows if r.presence_penalty != 0 or r.frequency_penalty != 0
                   or r.repetition_penalty != 1]
        counted_ids = {id(r) for r in counted}
        gen_n = max((len(r.output_ids or ()) for r in counted), default=0)
        prompt_n = max((len(r.prompt_ids or ()) for r in counted if r.repetition_penalty != 1), default=0)
        bias_n = max((len(r.bias[0]) for r in pen_rows if r.bias is not None), default=0)
        gen = np.full((b, penalty_width(gen_n)), -1, np.int32)
        prompt = np.full((b, penalty_width(prompt_n) if prompt_n else 0), -1, np.int32)
        bias_ids = np.full((b, penalty_width(bias_n) if bias_n else 0), -1, np.int32)
        bias_vals = np.zeros(bias_ids.shape, np.float32)
        params = np.zeros((b, 4), np.float32)
        params[:, 2] = 1.0
        for i, r in enumerate(rows):
            if not r.has_penalty:
                continue
            params[i] = (r.presence_penalty, r.frequency_penalty, r.repetition_penalty, r.min_p)
            if id(r) in counted_ids and r.output_ids:
                gen[i, :len(r.output_ids)] = r.output_ids
            if r.repetition_penalty != 1 and r.prompt_ids:
                prompt[i, :len(r.prompt_ids)] = r.prompt_ids
            if r.bias is not None and r.bias[0]:
                bias_ids[i, :len(r.bias[0])] = r.bias[0]
                bias_vals[i, :len(r.bias[1])] = r.bias[1]
        return gen, prompt, params, bias_ids, bias_vals

    def write(self, fn, *args) -> None:
        """``self.cache = fn(self.cache, *args)``: a write to the page pool's arrays by another part
        (a tier promotion's scatter, blend's recompute).  The runner is their only writer: its own
        steps, copies and splices, and the writes handed to it here (tests/core/test_cache_writer.py)."""
        self.cache = fn(self.cache, *args)

    def place(self, sharding) -> None:
        """Commit the page pool's arrays to ``sharding`` (``jax.device_put`` aliases: no copy)."""
        self.cache = jax.device_put(self.cache, sharding)

    def run_splices(self, splices: list[Splice]) -> None:
        """Run KV chores now, in order, as one splice (a slot is the destination of at most one
        of them: each is its owner's, into pages it allocated)."""
        if len(splices) == 1:
            sp = splices[0]
            self.splice(sp.src, sp.dst, sp.shift)
        else:
            self.splice(*(np.concatenate([getattr(sp, f) for sp in splices]) for f in ("src", "dst", "shift")))

    def splice(self, src_slots, dst_slots, shift) -> None:
        """K/V of token slots src -> dst in every layer, K re-rotated by ``shift`` positions."""
        n = len(src_slots)
        m = next_pow2(n, 16)  # bucketed; padding entries have dst = -1 (skipped by the kernel)
        pad = lambda x, v=0: np.pad(np.asarray(x, np.int32), (0, m - n), constant_values=v)  # noqa: E731
        self.cache = _splice(self.cache, jnp.asarray(pad(src_slots)), jnp.asarray(pad(dst_slots, -1)),
                             jnp.asarray(pad(shift)), self.inv_freq)
