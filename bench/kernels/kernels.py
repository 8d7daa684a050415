"""Benchmark of the Pallas kernels: correctness against the references, then speed.

The backend is detected: on a GPU the default sections are ``abcde`` (the Triton-style kernels of
``pallas_kernels/``); on a TPU ``at`` (the ceilings and the Mosaic kernels of ``pallas_kernels/tpu/``,
section t, docs/tpu.md).  Usage (from the repository root)::

    python bench/kernels/kernels.py --out bench/results          # full run on an H200, ~3-5 minutes
    python bench/kernels/kernels.py --out bench/results/tpu      # on a TPU VM: sections a and t
    python bench/kernels/kernels.py --quick --out /tmp/kq        # tiny shapes, also on CPU (interpret)
    python bench/kernels/kernels.py --quick --sections t --out /tmp/kt  # the TPU section on CPU (TPU interpret mode)
    python bench/kernels/kernels.py --tune --sections b           # + decode knob sweep (~2 more minutes)

Sections (each guarded: a failure prints its traceback and the run goes on):

a. Ceilings.  Device copy bandwidth: ``x + c`` and a copy over a 1 GiB array, (bytes read +
   written) / time - the ceiling of kernels that write as much as they read (splice, KV write).
   Read-only bandwidth: a float32-accumulating sum over 2 GiB of bf16 (``common.read_bandwidth``)
   - the ceiling of kernels that only read (decode and cascade attention).  Matmul ceiling: the
   bf16 FLOP/s of a chain of 8192^3 matmuls (``common.matmul_ceiling``), the measured compute
   ceiling beside the datasheet's 989 TFLOP/s (``common.H200_BF16_PEAK``).
b. Decode attention, B in {1, 8, 32, 128} x ctx in {1k, 4k, 16k, 32k} (``--decode-shapes 32x4096,...``
   picks others), 32 q / 8 kv heads,
   d=128, page 16, bf16: time, effective bandwidth (K+V read + q + out) and its fraction of
   the bandwidth ceiling, the larger of the read-only and copy figures (on the H200 an XLA reduction
   reads slower than a copy moves, and the decode kernel outran it), the copy's fraction beside it;
   side by side ``jax.experimental.pallas.ops.gpu.paged_attention`` (same page layout, its knobs
   swept) and tokamax's dense attention if importable.  The plot shows the ceiling fraction.
c. Prefill attention: chunk {64, 512, 2048} over {4k, 16k} cached tokens, B=1, 32/8 heads:
   TFLOP/s counting unmasked work only, ``4 * T * (cached + (T + 1) / 2) * D * Hq``, and its
   MFU (of the datasheet peak and of the measured matmul ceiling).  The headline peer is cuDNN
   flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``) doing the same
   useful work through its causal path: two calls in one jitted function, the chunk's queries
   against the chunk's own K/V with ``is_causal=True`` (top-left alignment is right for that
   square block) and against the cached K/V with no mask (the full rectangle); both outputs are
   returned so neither call is dropped.  Merging the two partial results by their log-sum-exp is
   not counted, which underestimates cuDNN's cost (in cuDNN's favour).  The ratio column is
   cuDNN time / ours (> 1: ours is faster).  For context, two secondary peers: cuDNN on the whole
   dense problem with a boolean mask for the causal tail (cuDNN has no bottom-right causal mask in
   that API; the mask becomes a bias, no tile is skipped, so this flatters ours) and cuDNN with
   no mask at all (the full T x S_kv, a bound); all flops counted the same way.  Off the GPU
   (``--quick`` on CPU) the peers run with ``implementation=None`` (XLA), which only exercises
   the code path.
d. KV splice with RoPE shift: 4096 tokens, one layer per call and all 32 layers in one call.
e. KV write of a 2048-token chunk: XLA scatter (``write_kv``) and Pallas (``write_kv_pallas``).
f. Shared-prefix (cascade) decode, not in the default list (``--sections f``): B in
   {8, 32, 128} rows sharing one 4096-token prefix + 64 own tokens each, 32/8 heads, d=128,
   page 16, bf16.  ``shared_prefix_decode_attention`` versus ``paged_decode_attention`` over
   the concatenated page lists (outputs checked against each other), the suffix-only decode
   (``return_lse=True``) for the split of the time, and effective bandwidth counting the
   shared K/V once plus the suffixes (the decode column counts what it reads: B copies), as a
   fraction of the bandwidth ceiling (main column) and of the copy bandwidth.
t. The TPU kernels (default on a TPU; ``--sections t`` elsewhere runs them in TPU interpret mode):
   ``ragged_paged_attention_tpu`` on decode steps (B in {8, 64} rows x ctx in {1k, 4k}) and a mixed
   step (one 512-token chunk over 4k cached + 32 decode rows), against the jnp reference compiled by
   XLA (checked, and timed as the peer), effective bandwidth (K + V read) beside the copy ceiling;
   ``write_kv_tpu`` against the XLA scatter ``write_kv`` (2048 tokens); ``splice_kv_tpu`` against the
   XLA ``splice_kv_ref`` (4096 tokens, one layer).  32 q / 8 kv heads, d=128, page 16, bf16.

Timing: every measurement jit-compiles R kernel calls on R different input sets (so XLA
cannot merge them and the data rotates through more memory than the 60 MB L2), warms up,
then takes the median over repetitions of the whole executable divided by R.  In-place
kernels (splice, write) are chained with donated buffers.  Correctness: relative error
``max|out - ref| / max|ref|`` is printed for every checked case; any failure makes the
script exit non-zero after writing the report (``kernels.md`` and ``kernels.png``).
"""

from __future__ import annotations

import functools
import math
import os
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import H200_BF16_PEAK, matmul_ceiling, parse_shapes, read_bandwidth  # noqa: E402  (bench/lib/common.py)
from report import FAILURES, MD, code_version, log, pyplot, save_plot, section, table, write_md  # noqa: E402  (bench/lib/report.py)
from sections import parser, run_sections  # noqa: E402  (bench/lib/sections.py)
import numpy as np  # noqa: E402

from pallas_kernels.decode_attention import (  # noqa: E402
    auto_num_splits, auto_pages_per_block, paged_decode_attention, paged_decode_attention_ref)
from pallas_kernels.cascade_attention import (  # noqa: E402
    shared_prefix_decode_attention, shared_prefix_decode_attention_ref)
from pallas_kernels.kv_write import write_kv, write_kv_pallas, write_kv_ref  # noqa: E402
from pallas_kernels.splice import splice_kv, splice_kv_ref  # noqa: E402
from pallas_kernels.ragged_attention import ragged_paged_attention_ref  # noqa: E402
from pallas_kernels.tpu import ragged_paged_attention_tpu, splice_kv_tpu, write_kv_tpu  # noqa: E402

DT = jnp.bfloat16
HQ, HKV, D, S = 32, 8, 128, 16
PLOT: dict = {}


# ---------------------------------------------------------------- helpers

def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(1e-6, float(np.max(np.abs(ref)))))


def check(name, out, ref, tol=2e-2):
    err = rel_err(out, ref)
    ok = err <= tol
    log(f"  check {name}: rel err {err:.2e} {'ok' if ok else f'FAIL (> {tol})'}")
    if not ok:
        FAILURES.append(f"{name}: rel err {err:.3g}")
    return err


# seconds of back-to-back runs before the timed ones on a GPU (bench/NOTES.md, run AV; none elsewhere: interpret
# mode's calls take seconds); BENCH_WARM_S=0: the harness before it
WARM_S = float(os.environ.get("BENCH_WARM_S", "0.2"))


def _warm(run):
    """``run()`` back to back for ``WARM_S`` seconds (on a GPU only)."""
    end = time.perf_counter() + (WARM_S if jax.default_backend() == "gpu" else 0.0)
    while time.perf_counter() < end:
        jax.block_until_ready(run())


def _median(run, reps):
    """Median wall time of run() (blocking) over reps runs, after ``WARM_S`` of back-to-back runs on a GPU: one whose
    SM clock idles low (345 MHz on one H100 host) otherwise runs short timed calls before it has boosted."""
    _warm(run)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_time(fn, args, reps):
    """Median wall time of fn(*args) after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    return _median(lambda: fn(*args), reps)


def _multi(call):
    """One executable of ``call`` over every variant (R distinct input sets: XLA cannot merge the calls)."""
    return jax.jit(lambda sh, vs: [call(*sh, *v) for v in vs])


def time_calls(call, shared, variants, reps):
    """(seconds per call, outputs) of call(*shared, *variant) for every variant.

    The R = len(variants) calls are compiled into one executable: R distinct input sets keep
    XLA from merging them and amortise the dispatch overhead over R kernels."""
    return _host_time(_multi(call), shared, variants, reps)


def time_calls_and_device(call, shared, variants, reps):
    """``time_calls``' (seconds per call, outputs), then ``device_time_calls``' (GPU seconds per call, kernel rows)
    of the same executable, compiled once."""
    multi = _multi(call)
    return _host_time(multi, shared, variants, reps) + _device_time(multi, shared, variants, reps)


def _host_time(multi, shared, variants, reps):
    outs = jax.block_until_ready(multi(shared, variants))  # compile + warm up
    return _median(lambda: multi(shared, variants), reps) / len(variants), outs


def device_time_calls(call, shared, variants, reps):
    """(seconds per call the GPU spent in kernels, [(line, kernel, us per call, launches per call)]) of an
    executable like ``time_calls``' (compiled again), from the profiler (``bench/lib/profile_ops.py``): the
    kernels' and copies' durations on the GPU's stream lines, summed (no dispatch or sync time; a second stream's
    overlap would be counted twice).  NaN and [] off the GPU, and with ``INFERSCALE_BENCH_DEVICE_TIME=0`` (for a
    run under Nsight Compute)."""
    return _device_time(_multi(call), shared, variants, reps)


def _device_time(multi, shared, variants, reps):
    # (INFERSCALE_BENCH_DEVICE_TIME=0: none, NaN and [] as off the GPU - the profiler's CUPTI session cannot
    # run under Nsight Compute, whose own one crashes the process, bench/NOTES.md run BD)
    if jax.default_backend() != "gpu" or os.environ.get("INFERSCALE_BENCH_DEVICE_TIME", "1") == "0":
        return math.nan, []
    from profile_ops import kernel_times
    jax.block_until_ready(multi(shared, variants))
    _warm(lambda: multi(shared, variants))
    kt = kernel_times(lambda: jax.block_until_ready([multi(shared, variants) for _ in range(reps)]),
                      reps * len(variants), top=1000)
    return (sum(r[2] for r in kt) * 1e-6 if kt else math.nan), kt


def time_chain(step, state, variants, reps):
    """(seconds per step, final state) of state = step(*state, *variant), state donated."""
    def chain(st, vs):
        for v in vs:
            st = step(*st, *v)
        return st
    chain = jax.jit(chain, donate_argnums=0)
    box = [jax.block_until_ready(chain(state, variants))]  # compile + warm up

    def run():
        box[0] = chain(box[0], variants)
        return box[0]
    return _median(run, reps) / len(variants), box[0]


def gib(nbytes):
    return nbytes / 2**30


def fits(nbytes, frac=0.6):
    """Whether nbytes of new arrays fit in the device memory (unknown: assume yes)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        return limit <= 0 or nbytes < frac * limit
    except Exception:  # noqa: BLE001
        return True


def random_pool(key, num_pages, layers=None, dtype=DT):
    """Random K and V pools; generated one [P, S, D] head at a time (no huge temporaries)."""
    shape = (HKV, num_pages, S, D) if layers is None else (layers, HKV, num_pages, S, D)
    lead = math.prod(shape[:-3])

    @jax.jit
    def make(k):
        return jax.lax.map(lambda kk: jax.random.normal(kk, shape[-3:], dtype),
                           jax.random.split(k, lead)).reshape(shape)

    k1, k2 = jax.random.split(key)
    return make(k1), make(k2)


# ---------------------------------------------------------------- (a) copy bandwidth

@section
def copy_bandwidth(args):
    """The ceilings.  Two device copies of a random bf16 array, read + write counted; the faster is
    the copy ceiling (``args.copy_bw``): a donated ``x = x + c`` (an XLA fusion) and a plain
    ``jnp.copy`` (a device memcpy).  Then the read-only ceiling (``args.read_bw``, a reduction,
    ``common.read_bandwidth``) and the bf16 matmul ceiling (``args.mm_flops``,
    ``common.matmul_ceiling``)."""
    n = (16 if args.quick else 1024) * 2**20 // 2
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), DT)
    c = jnp.asarray(0.5, DT)
    add = jax.jit(lambda a, b: a + b, donate_argnums=0)  # separate calls: one chained jit would fuse
    cp = jax.jit(lambda a: jax.lax.optimization_barrier(a).copy())
    rows = []

    def timed(step):
        for _ in range(3):
            step()
        jax.block_until_ready(x)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for _ in range(10):
                step()
            jax.block_until_ready(x)
            times.append((time.perf_counter() - t0) / 10)
        return statistics.median(times)

    def add_step():
        nonlocal x
        x = add(x, c)

    def copy_step():
        nonlocal x
        y = cp(x)
        x, _ = y, x  # the old buffer is freed; the copy becomes x
    bws = []
    for name, step in (("x = x + c (donated)", add_step), ("copy", copy_step)):
        t = timed(step)
        bws.append(2 * x.nbytes / t)
        rows.append([name, f"{gib(x.nbytes):.2f} GiB", f"{gib(2 * x.nbytes):.2f} GiB",
                     f"{t * 1e6:.0f}", f"{bws[-1] / 1e9:.0f}", ""])
    args.copy_bw = max(bws)
    x = None  # free the copy's array before the read-only one is allocated
    read_bytes = (16 if args.quick else 2048) * 2**20
    args.read_bw = read_bandwidth(read_bytes, args.reps)
    rows.append(["read-only sum (float32 acc.)", f"{gib(read_bytes):.2f} GiB", f"{gib(read_bytes):.2f} GiB",
                 f"{read_bytes / args.read_bw * 1e6:.0f}", f"{args.read_bw / 1e9:.0f}", ""])
    n = 256 if args.quick else 8192
    args.mm_flops = matmul_ceiling(n, args.reps)
    # read-bound kernels are held to the fastest bytes/s this device was seen to move: on the H200 an
    # XLA reduction reads at ~3.3 TB/s, below the ~4.0 TB/s copy, and the decode kernel beat it (118%)
    args.ceiling_bw = max(args.copy_bw, args.read_bw)
    rows.append([f"bf16 matmul {n}^3 (chain of 4)", f"2 x {n}^2 bf16", "",
                 f"{2 * n ** 3 / args.mm_flops * 1e6:.0f}", "", f"{args.mm_flops / 1e12:.1f}"])
    log(f"  copy {args.copy_bw / 1e9:.0f} GB/s, read-only {args.read_bw / 1e9:.0f} GB/s, "
        f"matmul {args.mm_flops / 1e12:.1f} TFLOP/s ({args.mm_flops / H200_BF16_PEAK:.0%} of "
        f"{H200_BF16_PEAK / 1e12:.0f})")
    table("a. Ceilings: copy bandwidth (read + write; the faster copy is the ceiling), read-only "
          f"bandwidth, bf16 matmul (datasheet peak {H200_BF16_PEAK / 1e12:.0f} TFLOP/s)",
          ["op", "array", "bytes moved", "time us", "GB/s", "TFLOP/s"], rows)


# ---------------------------------------------------------------- (b) decode

def decode_inputs(key, b, ctx, num_vars, min_pool_bytes):
    """Pool of pages, R (q, page table) variants over random pages, lengths = ctx."""
    pages_per_seq = ctx // S
    page_bytes = 2 * HKV * S * D * 2
    num_pages = 1 + max(b * pages_per_seq, min_pool_bytes // page_bytes)
    kp, vp = random_pool(key, num_pages)
    rng = np.random.default_rng(b * 100003 + ctx)
    tables = [jnp.asarray(rng.permutation(np.arange(1, num_pages))[:b * pages_per_seq]
                          .reshape(b, pages_per_seq), jnp.int32) for _ in range(num_vars)]
    qs = [jax.random.normal(jax.random.PRNGKey(i), (b, HQ, D), DT) for i in range(num_vars)]
    lens = jnp.full((b,), ctx, jnp.int32)
    return kp, vp, list(zip(qs, tables)), lens


@section
def decode(args):
    batches, ctxs = ([1, 2], [64, 256]) if args.quick else ([1, 8, 32, 128],
                                                            [1024, 4096, 16384, 32768])
    shapes = parse_shapes(args.decode_shapes) if args.decode_shapes else [(b, c) for b in batches for c in ctxs]
    interp = args.interpret
    jpa = tok = None
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
        jpa = functools.partial(paged_attention, interpret=interp)
    except Exception as e:  # noqa: BLE001
        log(f"  jax paged_attention unavailable: {e!r}")
    try:
        import tokamax
        tok = tokamax
    except Exception as e:  # noqa: BLE001
        log(f"  tokamax not importable ({e!r}): column skipped")
    ours = functools.partial(paged_decode_attention, interpret=interp)
    rows = []
    for b, ctx in shapes:
        kv_bytes = 2 * b * ctx * HKV * D * 2
        if not fits(kv_bytes + 2**28):
            rows.append([b, ctx, "skip: does not fit"] + [""] * 8)
            continue
        nv = 2 if args.quick else int(np.clip(2e-3 * 3e12 / max(kv_bytes, 1), 4, 16))
        kp, vp, variants, lens = decode_inputs(jax.random.PRNGKey(b + ctx), b, ctx, nv,
                                               0 if args.quick else 512 * 2**20)
        q0, t0 = variants[0]
        call = lambda k, v, l, q, t: ours(q, k, v, t, l)  # noqa: E731
        t_ours, outs = time_calls(call, (kp, vp, lens), variants, args.reps)
        nbytes = kv_bytes + 2 * b * HQ * D * 2
        bw = nbytes / t_ours
        t_jax = jax_out = t_tok = jax_cfg = None
        if jpa is not None:  # its best configuration (the sweep ours had), on the same function
            t_jax, jax_cfg, jax_out = jax_paged_best(jpa, (kp, vp, lens), variants, ctx // S, args.reps)
            if t_jax is None:
                log(f"  jax paged_attention B={b} ctx={ctx}: no configuration ran")
        r = b if b * ctx <= 32 * 4096 else max(1, 32 * 4096 // ctx)  # rows the ref can afford
        ref = paged_decode_attention_ref(q0[:r], kp, vp, t0[:r], lens[:r])
        err = check(f"decode B={b} ctx={ctx} vs ref ({r} of {b} rows)", outs[0][:r], ref)
        if jax_out is not None:  # the peer must compute the same function to be a peer
            check(f"jax paged_attention {jax_cfg} B={b} ctx={ctx} vs ref", jax_out[:r], ref)
        if tok is not None and not args.quick:
            t_tok = _time_tokamax(tok, b, ctx, args.reps)
        splits = auto_num_splits(b, HKV, math.ceil(ctx / (auto_pages_per_block(S) * S)))
        frac = bw / args.ceiling_bw if args.ceiling_bw else float("nan")
        frac_copy = bw / args.copy_bw if args.copy_bw else float("nan")
        rows.append([b, ctx, f"{t_ours * 1e6:.1f}", f"{bw / 1e9:.0f}", f"{frac:.0%}",
                     f"{frac_copy:.0%}", splits, f"{err:.1e}",
                     f"{t_jax * 1e6:.1f} ({jax_cfg})" if t_jax else "n/a",
                     f"{t_jax / t_ours:.2f}x" if t_jax else "n/a",
                     f"{t_tok * 1e6:.1f}" if t_tok else "n/a"])
        PLOT.setdefault("decode", []).append((b, ctx, frac, (nbytes / t_jax / args.ceiling_bw)
                                              if t_jax and args.ceiling_bw else None))
        log(f"  B={b} ctx={ctx}: {t_ours * 1e6:.1f} us, {bw / 1e9:.0f} GB/s ({frac:.0%} of the ceiling)"
            + (f", jax {t_jax * 1e6:.1f} us" if t_jax else ""))
        del kp, vp, variants
    table("b. Decode attention (32 q / 8 kv heads, d=128, page 16, bf16)",
          ["B", "ctx", "ours us", "GB/s", "of ceiling", "of copy", "splits", "rel err", "jax-pallas us",
           "speedup", "tokamax dense us"], rows)


def jax_paged_best(jpa, shared, variants, pages_per_seq, reps):
    """jax's Pallas ``paged_attention`` at its best ``pages_per_compute_block`` x ``k_splits``
    (the knobs it documents; ours were swept the same way in ``decode_tune``).  The op applies no
    1/sqrt(d) to the logits, so q is scaled first: it then computes what ours computes.  Returns
    (seconds, "ppb=P ks=K", output of the first variant), or (None, None, None)."""
    best = (None, None, None)
    for ks in (1, 4, 8, 16):
        for ppb in (4, 8, 16):
            if pages_per_seq % ks or (pages_per_seq // ks) % min(ppb, pages_per_seq // ks):
                continue
            fn = functools.partial(jpa, k_splits=ks, pages_per_compute_block=ppb)

            def call(k, v, lens, q, t, fn=fn):
                return fn((q * q.shape[-1] ** -0.5).astype(q.dtype), k, v, t, lens)
            try:
                t, outs = time_calls(call, shared, variants, max(2, reps // 2))
            except Exception as e:  # noqa: BLE001 - a configuration the op rejects
                log(f"    jax paged_attention ks={ks} ppb={ppb}: {type(e).__name__}")
                continue
            if best[0] is None or t < best[0]:
                best = (t, f"ppb={ppb} ks={ks}", outs[0])
    return best


def _time_tokamax(tok, b, ctx, reps):
    """tokamax's dense attention on contiguous K/V of the same size (a non-paged reference)."""
    try:
        q = jax.random.normal(jax.random.PRNGKey(0), (b, 1, HQ, D), DT)
        k = jax.random.normal(jax.random.PRNGKey(1), (b, ctx, HKV, D), DT)
        v = jax.random.normal(jax.random.PRNGKey(2), (b, ctx, HKV, D), DT)
        return median_time(jax.jit(lambda q, k, v: tok.dot_product_attention(q, k, v)),
                           (q, k, v), reps)
    except Exception as e:  # noqa: BLE001
        log(f"  tokamax B={b} ctx={ctx} failed: {e!r}")
        return None


@section
def decode_tune(args):
    """Sweep the decode knobs on a few shapes; print the best configuration per shape."""
    shapes = [(2, 256)] if args.quick else [(32, 4096), (1, 32768), (1, 1024), (8, 4096)]
    knobs = [(ppb, w, st) for ppb in (2, 4, 8) for w in (4, 8) for st in (2, 3)]
    if args.quick:
        knobs = knobs[:2]
    rows = []
    for b, ctx in shapes:
        kp, vp, variants, lens = decode_inputs(jax.random.PRNGKey(7), b, ctx, 4, 0)
        base = auto_num_splits(b, HKV, math.ceil(ctx / 64))
        results = []
        for ppb, w, st in knobs:
            for ns in sorted({max(1, base // 2), base, base * 2}):
                fn = functools.partial(paged_decode_attention, pages_per_block=ppb,
                                       num_warps=w, num_stages=st, num_splits=ns,
                                       interpret=args.interpret)
                try:
                    t, _ = time_calls(lambda k, v, l, q, tb: fn(q, k, v, tb, l),
                                      (kp, vp, lens), variants, max(3, args.reps // 2))
                    results.append((t, ppb, w, st, ns))
                except Exception as e:  # noqa: BLE001
                    log(f"  ppb={ppb} warps={w} stages={st} splits={ns}: {e!r}")
        results.sort()
        nbytes = 2 * b * ctx * HKV * D * 2
        for t, ppb, w, st, ns in results[:3]:
            rows.append([b, ctx, ppb, w, st, ns, f"{t * 1e6:.1f}", f"{nbytes / t / 1e9:.0f}"])
    table("b'. Decode knob sweep (best 3 per shape)",
          ["B", "ctx", "pages/block", "warps", "stages", "splits", "us", "GB/s"], rows)


# ---------------------------------------------------------------- (c) prefill

@section
def prefill(args):
    from pallas_kernels.prefill_attention import (paged_prefill_attention,
                                                  paged_prefill_attention_ref)
    hq, hkv = (4, 2) if args.quick else (HQ, HKV)
    chunks, cached_list = ([16, 32], [64]) if args.quick else ([64, 512, 2048], [4096, 16384])
    nv = 2 if args.quick else 4  # input sets: separate K/V (and pages) per call
    ours = functools.partial(paged_prefill_attention, interpret=args.interpret)
    # the peers: cuDNN on the GPU; elsewhere XLA (implementation=None), only to exercise the code
    impl = "cudnn" if jax.default_backend() == "gpu" else None
    peer = impl or "xla"
    dpa = functools.partial(jax.nn.dot_product_attention, implementation=impl)

    def causal_two_calls(q, kc, vc, kn, vn):
        """The same useful work through the causal path: the chunk's square block (top-left
        causal) and the cached rectangle (no mask); the LSE merge of the two is not done."""
        return dpa(q, kn, vn, is_causal=True), dpa(q, kc, vc)

    def peer_time(name, fn, shared, variants):
        """(seconds per call, outputs) of a peer, or (None, None) when it fails (no cuDNN...)."""
        try:
            return time_calls(fn, shared, variants, args.reps)
        except Exception as e:  # noqa: BLE001 - the column says n/a
            log(f"  {peer} {name} failed: {(str(e).splitlines() or [repr(e)])[0][:200]}")
            return None, None

    rows = []
    for cached in cached_list:
        for t in chunks:
            total = cached + t
            pages = math.ceil(total / S)
            num_pages = 1 + nv * pages
            perm = np.random.default_rng(t).permutation(np.arange(1, num_pages))
            kp = jnp.zeros((hkv, num_pages * S, D), DT)
            vp = jnp.zeros((hkv, num_pages * S, D), DT)
            dense, split, paged = [], [], []
            for i in range(nv):
                keys = jax.random.split(jax.random.PRNGKey(1000 * t + i), 3)
                q = jax.random.normal(keys[0], (1, t, hq, D), DT)
                k = jax.random.normal(keys[1], (1, total, hkv, D), DT)  # [1, S_kv, Hkv, D]
                v = jax.random.normal(keys[2], (1, total, hkv, D), DT)
                ids = perm[i * pages:(i + 1) * pages]
                slots = jnp.asarray((ids[:, None] * S + np.arange(S)).reshape(-1)[:total])
                kp = kp.at[:, slots].set(k[0].transpose(1, 0, 2))
                vp = vp.at[:, slots].set(v[0].transpose(1, 0, 2))
                dense.append((q, k, v))
                # sliced here, outside the timed function: no copy is charged to the peer
                split.append((q, k[:, :cached], v[:, :cached], k[:, cached:], v[:, cached:]))
                paged.append((q, jnp.asarray(ids[None], jnp.int32)))
            kp, vp = kp.reshape(hkv, num_pages, S, D), vp.reshape(hkv, num_pages, S, D)
            q_lens, kv_lens = jnp.array([t], jnp.int32), jnp.array([total], jnp.int32)
            t_ours, outs = time_calls(lambda k, v, ql, kl, q, tb: ours(q, k, v, tb, ql, kl),
                                      (kp, vp, q_lens, kv_lens), paged, args.reps)
            pos_q = cached + jnp.arange(t)
            mask = (jnp.arange(total)[None, :] <= pos_q[:, None])[None, None]  # [1,1,T,S_kv]
            where = f"T={t} cached={cached}"
            t_causal, _ = peer_time(f"causal (two calls) {where}", causal_two_calls, (), split)
            # bottom-right causal via a boolean mask (becomes a bias in cuDNN: no tile skipped)
            t_cudnn, couts = peer_time(f"dense + mask {where}",
                                       lambda m, q, k, v: dpa(q, k, v, mask=m), (mask,), dense)
            cudnn_out = couts[0] if couts else None
            t_full, _ = peer_time(f"no mask {where}", lambda q, k, v: dpa(q, k, v), (), dense)
            q0, table0 = paged[0]
            if t * total * hq * 4 < 2**32:
                ref = paged_prefill_attention_ref(q0, kp, vp, table0, q_lens, kv_lens)
                err = check(f"prefill T={t} cached={cached} vs ref", outs[0], ref)
            elif cudnn_out is not None:
                err = check(f"prefill T={t} cached={cached} vs {peer}+mask", outs[0], cudnn_out)
            else:
                err = float("nan")
            flops = 4 * t * (cached + (t + 1) / 2) * D * hq

            def fmt(sec):
                return (f"{sec * 1e6:.0f}", f"{flops / sec / 1e12:.1f}") if sec else ("n/a",) * 2

            tf = flops / t_ours
            mfu_mm = f"{tf / args.mm_flops:.1%}" if args.mm_flops else "n/a"
            rows.append([t, cached, *fmt(t_ours), f"{tf / H200_BF16_PEAK:.1%}", mfu_mm, f"{err:.1e}",
                         *fmt(t_causal), f"{t_causal / t_ours:.2f}x" if t_causal else "n/a",
                         *fmt(t_cudnn), *fmt(t_full)])
            log(f"  T={t} cached={cached}: ours {t_ours * 1e6:.0f} us ({tf / 1e12:.1f} TFLOP/s)"
                + (f", {peer} causal two calls {t_causal * 1e6:.0f} us "
                   f"({t_causal / t_ours:.2f}x)" if t_causal else ""))
            del kp, vp, dense, split, paged
    table(f"c. Prefill attention (B=1, {hq}/{hkv} heads, d=128, bf16; TFLOP/s of unmasked work only)",
          ["chunk", "cached", "ours us", "ours TFLOP/s", "MFU (datasheet)", "of matmul ceiling",
           "rel err", f"{peer} causal 2-call us", f"{peer} causal TFLOP/s", f"{peer}/ours",
           f"{peer}+mask us", f"{peer}+mask TFLOP/s", f"{peer} no-mask us",
           f"{peer} no-mask TFLOP/s"], rows)
    note = (f"MFU: ours TFLOP/s over the {H200_BF16_PEAK / 1e12:.0f} TFLOP/s bf16 datasheet peak and "
            f"over the measured matmul ceiling (section a).  {peer} causal 2-call: the same useful "
            "work as ours - the chunk's own T x T block with is_causal=True plus the T x cached "
            "rectangle with no mask, one jitted function, both outputs kept; the LSE merge of the "
            f"two partial results is not counted (in {peer}'s favour).  {peer}/ours: its time over "
            f"ours, > 1 means ours is faster.  Secondary: {peer}+mask runs the whole dense problem "
            "with a boolean mask (a bias: no tile skipped, flatters ours); no-mask does the full "
            "T x S_kv and is a bound.  All TFLOP/s count the unmasked work only.")
    log(note)
    MD.extend([note, ""])


@section
def prefill_tune(args):
    """Sweep the prefill knobs (tile rows via block_q, block_kv, warps, stages) on two shapes."""
    from pallas_kernels.prefill_attention import paged_prefill_attention
    hq, hkv = (4, 2) if args.quick else (HQ, HKV)
    g = hq // hkv
    shapes = [(32, 64)] if args.quick else [(512, 16384), (2048, 16384), (64, 16384)]
    knobs = [(bq, bkv, w, st) for bq in (128 // g, 64 // g) for bkv in (32, 64, 128)
             for w in (4, 8) for st in (2, 3)]
    if args.quick:
        knobs = knobs[:2]
    rows = []
    for t, cached in shapes:
        total = cached + t
        pages = math.ceil(total / S)
        num_pages = 1 + 2 * pages
        kp, vp = random_pool(jax.random.PRNGKey(t), num_pages)
        perm = np.random.default_rng(t).permutation(np.arange(1, num_pages))
        variants = [(jax.random.normal(jax.random.PRNGKey(i), (1, t, hq, D), DT),
                     jnp.asarray(perm[i * pages:(i + 1) * pages][None], jnp.int32)) for i in range(2)]
        q_lens, kv_lens = jnp.array([t], jnp.int32), jnp.array([total], jnp.int32)
        flops = 4 * t * (cached + (t + 1) / 2) * D * hq
        results = []
        for bq, bkv, w, st in knobs:
            fn = functools.partial(paged_prefill_attention, block_q=bq, block_kv=bkv, num_warps=w,
                                   num_stages=st, interpret=args.interpret)
            try:
                sec, _ = time_calls(lambda k, v, ql, kl, q, tb: fn(q, k, v, tb, ql, kl),
                                    (kp, vp, q_lens, kv_lens), variants, max(3, args.reps // 2))
                results.append((sec, bq * g, bkv, w, st))
            except Exception as e:  # noqa: BLE001
                log(f"  rows={bq * g} block_kv={bkv} warps={w} stages={st}: {str(e).splitlines()[0][:160]}")
        results.sort()
        for sec, rws, bkv, w, st in results[:4]:
            rows.append([t, cached, rws, bkv, w, st, f"{sec * 1e6:.0f}", f"{flops / sec / 1e12:.1f}"])
        del kp, vp
    table("c'. Prefill knob sweep (best 4 per shape; rows = block_q * Hq/Hkv)",
          ["chunk", "cached", "tile rows", "block_kv", "warps", "stages", "us", "TFLOP/s"], rows)


# ---------------------------------------------------------------- (d) splice

@section
def splice(args):
    n = 64 if args.quick else 4096
    inv_freq = (1.0 / 500000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    rows = []
    for layers in ((None, 2) if args.quick else (None, 32)):
        nl = 1 if layers is None else layers
        seg_pages = n // S
        nv = 2 if args.quick else 4
        num_pages = 1 + 2 * nv * seg_pages  # variant i: pages of run 2i -> run 2i + 1
        kp, vp = random_pool(jax.random.PRNGKey(nl), num_pages, layers)
        rng = np.random.default_rng(nl)
        variants = []
        for i in range(nv):  # page-aligned injected segment moved by `shift` positions
            src = jnp.asarray((1 + 2 * i * seg_pages) * S + np.arange(n), jnp.int32)
            dst = src + seg_pages * S
            variants.append((src, dst, jnp.full((n,), int(rng.integers(-3000, 3000)),
                                                jnp.int32)))
        src, dst, sh = variants[0]
        k1, v1 = splice_kv(kp, vp, src, dst, sh, inv_freq, interpret=args.interpret)
        kr, vr = splice_kv_ref(kp, vp, src, dst, sh, inv_freq)
        err = check(f"splice L={nl} K vs ref", k1, kr, 1e-2)
        check(f"splice L={nl} V vs ref (exact)", v1, vr, 0.0)
        del k1, v1, kr, vr
        nbytes = 2 * 2 * n * nl * HKV * D * 2  # K and V, read + write
        configs = [dict()]  # auto blocking
        if args.tune:
            configs += [dict(block_tokens=t_, heads_per_program=h_, num_warps=w_)
                        for t_ in (32, 64, 128) for h_ in (1, 2, HKV) for w_ in (4, 8)]
        for cfg in configs:
            step = functools.partial(splice_kv, inv_freq=inv_freq, interpret=args.interpret,
                                     **cfg)
            try:
                t, (kp, vp) = time_chain(step, (kp, vp), variants, args.reps)
            except Exception as e:  # noqa: BLE001
                log(f"  splice {cfg}: {e!r}")
                continue
            frac = nbytes / t / args.copy_bw if args.copy_bw else float("nan")
            rows.append([nl, n, cfg or "auto", f"{t * 1e6:.1f}", f"{nbytes / t / 1e9:.0f}",
                         f"{frac:.0%}", f"{err:.1e}"])
        del kp, vp
    table("d. KV splice with RoPE shift (bf16, 8 kv heads, d=128, page-aligned segments)",
          ["layers/call", "tokens", "config", "us/call", "GB/s", "of copy", "rel err"], rows)


# ---------------------------------------------------------------- (e) kv write

@section
def kv_write(args):
    n = 64 if args.quick else 2048
    nv = 2 if args.quick else 8
    num_pages = 1 + nv * n // S + (0 if args.quick else 4096)
    kp, vp = random_pool(jax.random.PRNGKey(3), num_pages)
    rng = np.random.default_rng(3)
    variants = []
    for i in range(nv):
        kn = jax.random.normal(jax.random.PRNGKey(10 + i), (n, HKV, D), DT)
        vn = jax.random.normal(jax.random.PRNGKey(20 + i), (n, HKV, D), DT)
        slots = rng.permutation(np.arange(S, num_pages * S))[:n].astype(np.int32)
        variants.append((kn, vn, jnp.asarray(slots)))
    kn, vn, sl = variants[0]
    ref = write_kv_ref(kp, vp, kn, vn, sl)
    rows = []
    for name, fn in (("write_kv (XLA)", write_kv),
                     ("write_kv_pallas", functools.partial(write_kv_pallas,
                                                           interpret=args.interpret))):
        out = fn(kp, vp, kn, vn, sl)
        err = check(f"{name} vs ref (exact)", out[0], ref[0], 0.0)
        check(f"{name} V vs ref (exact)", out[1], ref[1], 0.0)
        del out
        kc, vc = jnp.copy(kp), jnp.copy(vp)
        t, _ = time_chain(fn, (kc, vc), variants, args.reps)
        nbytes = 2 * 2 * n * HKV * D * 2  # K and V, read new + write slots
        rows.append([name, n, f"{t * 1e6:.1f}", f"{nbytes / 2**20:.1f}",
                     f"{nbytes / t / 1e9:.0f}", f"{err:.0e}"])
    table("e. KV write of one chunk (one layer, 8 kv heads, d=128, bf16)",
          ["impl", "tokens", "us/call", "MiB moved", "GB/s", "err"], rows)


# ---------------------------------------------------------------- (f) cascade decode

@section
def cascade(args):
    batches, shared, suffix = ([2, 5], 128, 16) if args.quick else ([8, 32, 128], 4096, 64)
    nv = 2 if args.quick else 4  # input sets: own shared pages, suffix pages and q per call
    sp_pages, sf_pages = shared // S, suffix // S
    interp = args.interpret
    ours = functools.partial(shared_prefix_decode_attention, interpret=interp)
    dec = functools.partial(paged_decode_attention, interpret=interp)
    tok_bytes = 2 * HKV * D * 2  # K + V of one token, all kv heads, bf16
    rows, tune_rows, profile_rows = [], [], []
    for b in batches:
        num_pages = 1 + nv * (sp_pages + b * sf_pages)
        kp, vp = random_pool(jax.random.PRNGKey(50 + b), num_pages)
        perm = np.random.default_rng(b).permutation(np.arange(1, num_pages)).astype(np.int32)
        n_sh = jnp.asarray(shared, jnp.int32)
        sf_lens = jnp.full((b,), suffix, jnp.int32)
        casc_vars, full_vars = [], []
        for i, ids in enumerate(np.split(perm, nv)):
            q = jax.random.normal(jax.random.PRNGKey(1000 * b + i), (b, HQ, D), DT)
            sh, st = ids[:sp_pages], ids[sp_pages:].reshape(b, sf_pages)
            full = np.concatenate([np.broadcast_to(sh, (b, sp_pages)), st], axis=1)
            casc_vars.append((q, jnp.asarray(sh), jnp.asarray(st)))
            full_vars.append((q, jnp.asarray(full)))
        full_lens = sf_lens + shared
        t_c, outs_c = time_calls(lambda k, v, n, l, q, sh, st: ours(q, k, v, sh, n, st, l),
                                 (kp, vp, n_sh, sf_lens), casc_vars, args.reps)
        t_d, outs_d = time_calls(lambda k, v, l, q, ft: dec(q, k, v, ft, l),
                                 (kp, vp, full_lens), full_vars, args.reps)
        t_s, _ = time_calls(lambda k, v, l, q, sh, st: dec(q, k, v, st, l, return_lse=True),
                            (kp, vp, sf_lens), casc_vars, args.reps)
        err = check(f"cascade B={b} vs decode over the full page lists", outs_c[0], outs_d[0])
        r = min(b, 32)  # rows the reference can afford
        q0, sh0, st0 = casc_vars[0]
        check(f"cascade B={b} vs ref ({r} of {b} rows)", outs_c[0][:r],
              shared_prefix_decode_attention_ref(q0[:r], kp, vp, sh0, n_sh, st0[:r],
                                                 sf_lens[:r]))
        qo = 2 * b * HQ * D * 2
        eff = shared * tok_bytes + b * suffix * tok_bytes + qo  # shared read once
        logical = b * (shared + suffix) * tok_bytes + qo  # what decode reads
        frac = (f"{eff / t_c / args.ceiling_bw:.0%}" if args.ceiling_bw else "n/a")
        frac_copy = (f"{eff / t_c / args.copy_bw:.0%}" if args.copy_bw else "n/a")
        rows.append([b, shared, suffix, f"{t_c * 1e6:.1f}", f"{t_d * 1e6:.1f}",
                     f"{t_d / t_c:.2f}x", f"{t_s * 1e6:.1f}", f"{eff / 2**20:.1f}",
                     f"{eff / t_c / 1e9:.0f}", frac, frac_copy, f"{logical / 2**20:.0f}",
                     f"{logical / t_d / 1e9:.0f}", f"{err:.1e}"])
        log(f"  B={b}: cascade {t_c * 1e6:.1f} us, decode {t_d * 1e6:.1f} us "
            f"({t_d / t_c:.2f}x), suffix-only decode {t_s * 1e6:.1f} us")
        if args.tune:
            cascade_tune(args, b, kp, vp, n_sh, sf_lens, casc_vars, eff, tune_rows)
        if args.profile:
            profile_rows += cascade_profile(args, b, ours, dec, kp, vp, n_sh, sf_lens, full_lens,
                                            casc_vars, full_vars)
        del kp, vp, casc_vars, full_vars, outs_c, outs_d
    table(f"f. Shared-prefix (cascade) decode vs paged decode over full page lists "
          f"({HQ}/{HKV} heads, d={D}, page {S}, bf16)",
          ["B", "shared", "suffix", "cascade us", "decode us", "speedup", "suffix-only us",
           "cascade MiB (shared once)", "cascade GB/s", "of ceiling", "of copy", "decode MiB",
           "decode GB/s",
           "rel err vs decode"], rows)
    if profile_rows:
        table("f''. Device time per call by kernel (profiler trace; host timings above include dispatch)",
              ["B", "call", "kernel", "us/call", "launches/call"], profile_rows)
    if tune_rows:
        table("f'. Cascade knob sweep (shared part; best 4 per B)",
              ["B", "block_rows", "block_kv", "warps", "stages", "splits", "us", "GB/s (shared once)"],
              tune_rows)


def cascade_profile(args, b, ours, dec, kp, vp, n_sh, sf_lens, full_lens, casc_vars, full_vars):
    """Kernel-by-kernel device time of the cascade call and of plain decode at batch b."""
    from profile_ops import kernel_times
    reps = 5
    cas = jax.jit(lambda k, v, n, l, vs: [ours(q, k, v, sh, n, st, l) for q, sh, st in vs])
    pla = jax.jit(lambda k, v, l, vs: [dec(q, k, v, ft, l) for q, ft in vs])
    rows = []
    for name, fn, a in (("cascade", cas, (kp, vp, n_sh, sf_lens, casc_vars)),
                        ("decode", pla, (kp, vp, full_lens, full_vars))):
        jax.block_until_ready(fn(*a))

        def run(fn=fn, a=a):
            for _ in range(reps):
                jax.block_until_ready(fn(*a))
        ktimes = kernel_times(run, reps * len(a[-1]))
        tot = sum(t for _, _, t, _ in ktimes)
        rows.append([b, name, "(all kernels)", f"{tot:.1f}", f"{sum(c for *_, c in ktimes):.1f}"])
        rows += [[b, name, k, f"{t:.1f}", f"{c:.1f}"] for _, k, t, c in ktimes]
        log(f"  B={b} {name}: device {tot:.1f} us/call over {len(ktimes)} kernel names")
    return rows


def cascade_tune(args, b, kp, vp, n_sh, sf_lens, casc_vars, eff, rows):
    """Sweep the shared part's knobs at batch b; append the best 4 to rows."""
    knobs = [(br, bk, w, st) for br in (64, 128) for bk in (32, 64, 128) for w in (4, 8)
             for st in (2, 3)]
    if args.quick:
        knobs = knobs[:2]
    results = []
    for br, bk, w, st in knobs:
        for ns in (None,):  # auto splits (2 programs per SM); compiles dominate the sweep
            fn = functools.partial(shared_prefix_decode_attention, block_rows=br, block_kv=bk,
                                   num_warps=w, num_stages=st, num_splits=ns,
                                   interpret=args.interpret)
            try:
                t, _ = time_calls(lambda k, v, n, l, q, sh, st_: fn(q, k, v, sh, n, st_, l),
                                  (kp, vp, n_sh, sf_lens), casc_vars, max(3, args.reps // 2))
                results.append((t, br, bk, w, st, "auto" if ns is None else ns))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip the combo
                log(f"  B={b} rows={br} kv={bk} warps={w} stages={st} splits={ns}: "
                    f"{type(e).__name__}: {str(e)[:120]}")
    results.sort(key=lambda r: r[0])
    for t, br, bk, w, st, ns in results[:4]:
        rows.append([b, br, bk, w, st, ns, f"{t * 1e6:.1f}", f"{eff / t / 1e9:.0f}"])
    if results:
        log(f"  B={b} tune best: {results[0]}")


# ---------------------------------------------------------------- (t) TPU kernels

def _ragged_step(key, rows, num_pages):
    """Random ragged inputs: ``rows`` = [(q_len, kv_len)], each row's pages consecutive from page 1."""
    q_lens = np.array([r[0] for r in rows], np.int32)
    kv_lens = np.array([r[1] for r in rows], np.int32)
    width = int(max(-(-kv_lens // S)))
    table = np.zeros((len(rows), width), np.int32)
    nxt = 1
    for i, kv in enumerate(kv_lens):
        n = -(-int(kv) // S)
        table[i, :n] = np.arange(nxt, nxt + n) % (num_pages - 1) + 1
        nxt += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jax.random.normal(key, (int(cu[-1]), HQ, D), DT)
    return q, jnp.asarray(table), jnp.asarray(cu), jnp.asarray(kv_lens)


@section
def tpu_kernels(args):
    interp = jax.default_backend() != "tpu"
    hq_note = f"{HQ}/{HKV} heads, d={D}, page {S}, bf16"
    steps = ([("decode", [(1, 64)] * 2), ("mixed", [(16, 48), (1, 40)])] if args.quick else
             [(f"decode B={b} ctx={c}", [(1, c)] * b) for b in (8, 64) for c in (1024, 4096)]
             + [("mixed 512/4k + 32 decode", [(512, 4096)] + [(1, 2048)] * 32)])
    rows = []
    for name, spec in steps:
        pages = 2 + sum(-(-kv // S) for _, kv in spec)
        kp, vp = random_pool(jax.random.PRNGKey(7), pages)
        q, table_, cu, kv = _ragged_step(jax.random.PRNGKey(8), spec, pages)
        ours = jax.jit(functools.partial(ragged_paged_attention_tpu, interpret=interp))
        ref = jax.jit(ragged_paged_attention_ref)
        err = check(f"ragged tpu {name}", ours(q, kp, vp, table_, cu, kv), ref(q, kp, vp, table_, cu, kv))
        t_ours = median_time(ours, (q, kp, vp, table_, cu, kv), args.reps)
        t_ref = median_time(ref, (q, kp, vp, table_, cu, kv), args.reps)
        nbytes = 2 * sum(kv for _, kv in spec) * HKV * D * 2  # K + V read once per row
        frac = nbytes / t_ours / args.copy_bw if args.copy_bw else float("nan")
        rows.append([name, f"{t_ours * 1e6:.0f}", f"{t_ref * 1e6:.0f}", f"{t_ref / t_ours:.2f}",
                     f"{nbytes / t_ours / 1e9:.0f}", f"{frac:.0%}", f"{err:.1e}"])
    table(f"t1. Ragged paged attention, TPU kernel vs jnp reference (XLA), {hq_note}",
          ["step", "ours us", "ref us", "ref/ours", "GB/s", "of copy", "rel err"], rows)
    n = 64 if args.quick else 2048
    kp, vp = random_pool(jax.random.PRNGKey(9), 2 + 2 * n // S)
    kn = jax.random.normal(jax.random.PRNGKey(10), (n, HKV, D), DT)
    slots = jnp.asarray(np.random.default_rng(0).permutation(np.arange(S, (2 + 2 * n // S) * S))[:n], jnp.int32)
    src = jnp.arange(S, S + n, dtype=jnp.int32)
    shift = jnp.full((n,), 1000, jnp.int32)
    inv_freq = (1.0 / 500000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    rows = []
    for name, fn, ref, a in (
            ("write_kv", functools.partial(write_kv_tpu, interpret=interp), write_kv, (kn, kn, slots)),
            ("splice (shift 1000)", functools.partial(splice_kv_tpu, inv_freq=inv_freq, interpret=interp),
             functools.partial(splice_kv_ref, inv_freq=inv_freq), (src, src + n, shift))):
        err = check(f"{name} tpu vs XLA", fn(kp, vp, *a)[0], ref(kp, vp, *a)[0], 1e-2)
        t_ours, _ = time_chain(fn, (jnp.copy(kp), jnp.copy(vp)), [a], args.reps)
        t_ref, _ = time_chain(ref, (jnp.copy(kp), jnp.copy(vp)), [a], args.reps)
        nbytes = 2 * 2 * n * HKV * D * 2  # K and V, read + write
        rows.append([name, n, f"{t_ours * 1e6:.0f}", f"{t_ref * 1e6:.0f}", f"{t_ref / t_ours:.2f}",
                     f"{nbytes / t_ours / 1e9:.0f}", f"{err:.1e}"])
    table(f"t2. KV write and splice, TPU kernels vs XLA (one layer, {hq_note})",
          ["kernel", "tokens", "ours us", "XLA us", "XLA/ours", "GB/s", "rel err"], rows)


# ---------------------------------------------------------------- report

def write_report(args):
    dev = jax.devices()[0]
    head = [f"# Kernel benchmark ({'quick' if args.quick else 'full'})", "",
            f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
            f"interpret={args.interpret}", "",
            f"command: `python bench/kernels/kernels.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`", "",
            f"code: {code_version()}", ""]
    if FAILURES:
        head += ["**FAILURES:**", ""] + [f"- {f}" for f in FAILURES] + [""]
    write_md(args.out, "kernels.md", head + MD)
    if not PLOT.get("decode"):
        return
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in sorted({r[0] for r in PLOT["decode"]}):
        pts = [r for r in PLOT["decode"] if r[0] == b]
        line, = ax.plot([r[1] for r in pts], [r[2] for r in pts], "o-", label=f"ours B={b}")
        jx = [(r[1], r[3]) for r in pts if r[3] is not None]
        if jx:
            ax.plot(*zip(*jx), "x--", color=line.get_color(), label=f"jax-pallas B={b}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length")
    ax.set_ylabel("fraction of the bandwidth ceiling (max of read-only, copy)")
    ax.set_title("Paged decode attention (32/8 heads, d=128, page 16, bf16)")
    ax.axhline(0.75, color="gray", lw=0.8, ls=":")
    ax.legend(fontsize=7, ncol=2)
    save_plot(fig, args.out, "kernels.png")


def main():
    ap = parser(__doc__, "tiny shapes (works on CPU)")
    ap.add_argument("--tune", action="store_true", help="also sweep the decode and prefill knobs")
    ap.add_argument("--sections", default=None,
                    help="subset of a,b,c,d,e,f,t to run (default abcde; at on a TPU; f, cascade "
                         "decode, and t, the TPU kernels, elsewhere only when named)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--decode-shapes", default=None,
                    help="section b: BxCTX pairs, comma separated (default: B 1/8/32/128 x ctx 1k-32k)")
    ap.add_argument("--profile", action="store_true",
                    help="section f: also the device time of each kernel (jax profiler trace)")
    args = ap.parse_args()
    args.interpret = jax.default_backend() != "gpu"
    if args.sections is None:  # the backend's own kernels
        args.sections = "at" if jax.default_backend() == "tpu" else "abcde"
    args.reps = args.reps or (2 if args.quick else 10)
    args.copy_bw = args.read_bw = args.ceiling_bw = args.mm_flops = None
    plan = [("abcdft", copy_bandwidth),  # the ceilings the later sections divide by
            ("b", decode), ("b" if args.tune else "", decode_tune), ("c", prefill), ("c" if args.tune else "", prefill_tune),
            ("d", splice), ("e", kv_write), ("f", cascade), ("t", tpu_kernels)]
    return run_sections(args, plan, report, note=f"interpret={args.interpret}")


def report(args, t0):
    MD.append(f"total time: {time.time() - t0:.0f} s")
    write_report(args)


if __name__ == "__main__":
    sys.exit(main())
