"""Compressed KV: kernel speed and end-to-end quality of int8 / float8_e4m3fn pages vs the model's dtype.

Usage (from the repository root)::

    python bench/kernels/kv_dtype.py --out bench/results                    # H200: kernels + quality, ~3 min
    python bench/kernels/kv_dtype.py --model /tmp/small-lm --sections b      # quality on a trained checkpoint
    python bench/kernels/kv_dtype.py --quick --out /tmp/kvq                  # tiny shapes on the CPU (interpret)
    python bench/kernels/kv_dtype.py --sections bc --model /tmp/small-lm-cpu --corpus-mb 6 --lengths 512,1024,2048 \
        --name kv_dtype_quality_cpu.md                               # quality on the CPU (jnp references)

a. Kernels (32 q / 8 kv heads, d=128, page 16): paged decode at B in {32, 128} x context {4k, 16k},
   B=32 over 32k and B=1 over 16k, each compressed dtype in the kernels' default scale form
   (``pallas_kernels/quant.py`` ``scales_on_rows``: int8 folded into scores and probabilities, float8 on
   the rows) and at two shapes also in the other form and with other knobs; the ragged kernel on a
   2048-token chunk over 16k in both forms of V; bf16 pages beside them.  Per row: time, bytes read (a
   compressed row is D + 4 bytes: values and its float32 scale), GB/s and the fraction of the bandwidth
   ceiling (max of the read-only reduction and a copy,
   ``bench/lib/common.py``), speed-up over bf16, and the error of each against the bf16 reference on the
   same (unquantized) K/V with outlier channels (a few 20x larger, as a real K has), and the kernel's
   own error against the reference on the same compressed pages (the first 8 rows of each batch).
b. Quality, end to end: an engine per KV dtype over the same weights (``--model`` folder, default
   random Llama weights of a small shape); a segment of L tokens (L in 1k, 4k, 8k; shorter in
   ``--quick``) injected before a 32-token question, 128 greedy tokens.  Per KV dtype vs the model's
   dtype: greedy agreement (tokens equal up to the first difference / 128) and the mean per-token KL
   divergence of the next-token distributions (top-20 log-probs, ``SamplingParams(logprobs=20)``,
   both renormalised over the tokens in both top-20s, up to the first differing token).  Random weights have flat distributions, so their KL
   says little: pass a trained checkpoint (``bench/tools/train_small_lm.py``) for the figures that count.

c. Injection modes: compose and blend against exact (exact with bf16 KV the reference) over 3
   segments of 1k + a 32-token question, for each KV dtype: greedy agreement and KL.
v. A layout experiment: V pages stored token-contiguous ([Hkv, P, D, S], one page per block) vs the
   usual [S, D], bf16 / int8 / fp8 at pages of 64 and 128 tokens (``v_transposed`` of the decode kernel).
s. The quantized splice's added error (keys dequantized, re-rotated, quantized again) against quantizing
   the rotated key once, on random keys with outliers and, with ``--model``, a trained model's keys.

Writes ``kv_dtype.md`` to ``--out``.
"""

from __future__ import annotations

import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import back_to_back, copy_bandwidth, parse_shapes, read_bandwidth  # noqa: E402  (bench/lib/common.py)
from report import FAILURES, MD, finish, log, section, table  # noqa: E402  (bench/lib/report.py)
from sections import parser, run_sections  # noqa: E402  (bench/lib/sections.py)

from pallas_kernels.quant import scales_on_rows  # noqa: E402

KV_DTYPES = ("int8", "float8_e4m3fn")
R: dict = {}


def timeit(fn, reps):
    """Seconds per call, calls issued back to back (``common.back_to_back``): max(3, reps // 10) samples of 10
    calls (of 2 with ``reps`` < 10, the CPU's interpret mode)."""
    jax.block_until_ready(fn())
    return back_to_back(fn, max(3, reps // 10), inner=10 if reps >= 10 else 2)


def ceiling(quick):
    n = (64 << 20) if quick else (2 << 30)
    return max(read_bandwidth(n), copy_bandwidth(n))


def pages(hkv, p, s, d, key):
    k1, k2 = jax.random.split(key)
    big = jnp.where(jnp.arange(d) < 4, 20.0, 1.0)
    return (jax.random.normal(k1, (hkv, p, s, d)) * big).astype(jnp.bfloat16), \
        jax.random.normal(k2, (hkv, p, s, d)).astype(jnp.bfloat16)


def decode_case(b, ctx, hq, hkv, s, d, seed):
    """(q, k, v, page_table, lengths): ``b`` sequences of ``ctx`` tokens on their own pages (page 0 left
    null), K with outlier channels (``pages``)."""
    per = ctx // s
    k, v = pages(hkv, b * per + 1, s, d, jax.random.PRNGKey(seed))
    q = jax.random.normal(jax.random.PRNGKey(1), (b, hq, d)).astype(jnp.bfloat16)
    tbl = (1 + jnp.arange(b * per, dtype=jnp.int32)).reshape(b, per)
    return q, k, v, tbl, jnp.full((b,), ctx, jnp.int32)


def pages_as(name, k, v):
    """(k pages, v pages, scale arrays, bytes of one head-row) of bf16 K/V stored as ``name``."""
    from pallas_kernels.quant import quantize_kv

    if name == "bfloat16":
        return k, v, {}, k.shape[-1] * 2
    (kp, ks), (vp, vs) = quantize_kv(k, jnp.dtype(name)), quantize_kv(v, jnp.dtype(name))
    return kp, vp, dict(k_scale=ks, v_scale=vs), k.shape[-1] + 4


def time_decode(args, q, kp, vp, tbl, lens, arrays, static):
    """(seconds per call, output) of the decode kernel; the pages are arguments of the jit, never
    closed-over constants (XLA would embed gigabytes in the program)."""
    from pallas_kernels.decode_attention import paged_decode_attention

    interp = jax.default_backend() != "gpu"
    f = jax.jit(lambda q, kp, vp, tbl, lens, arrays: paged_decode_attention(
        q, kp, vp, tbl, lens, interpret=interp, **arrays, **static))
    t = timeit(lambda: f(q, kp, vp, tbl, lens, arrays), 3 if args.quick else 50)
    return t, f(q, kp, vp, tbl, lens, arrays)


def form_label(name, rows, what="") -> str:
    """A table row's pages: the dtype and its scale form (``rows`` None: the kernel's default, named as such)."""
    if name == "bfloat16":
        return name

    def form(r):
        return f"{what + ' ' if what else ''}scales {'on rows' if r else 'folded'}"
    return f"{name} (default: {form(scales_on_rows(name))})" if rows is None else f"{name}, {form(rows)}"


def rel_err(out, ref) -> float:
    return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


@section
def kernels(args):
    from pallas_kernels.decode_attention import paged_decode_attention_ref
    from pallas_kernels.quant import quantize_kv
    from pallas_kernels.ragged_attention import ragged_paged_attention

    interp = jax.default_backend() != "gpu"
    hq, hkv, d, s = (8, 2, 16, 8) if args.quick else (32, 8, 128, 16)
    bw = ceiling(args.quick)
    R["bw"] = bw
    rows = []
    shapes = [(1, 64), (4, 128)] if args.quick else [(1, 16384), (32, 4096), (128, 4096), (32, 16384),
                                                    (128, 16384), (32, 32768)]
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    rows_variant = {(4, 128)} if args.quick else {(128, 4096), (32, 16384)}  # scales on the rows, as before
    n_chk = 8  # the rows checked against the references (the first n_chk of the batch)
    for b, ctx in shapes:
        t_shape = time.perf_counter()
        q, k, v, tbl, lens = decode_case(b, ctx, hq, hkv, s, d, seed=b + ctx)
        c = min(b, n_chk)
        ref = paged_decode_attention_ref(q[:c], k, v, tbl[:c], lens[:c]).astype(jnp.float32)
        base = None
        # fold None: the kernel's default form for the page dtype (quant.scales_on_rows)
        variants = [("bfloat16", None, {})] + [(n, None, {}) for n in KV_DTYPES]
        if args.knobs:  # only these knob sets, on every page dtype
            variants += [(n, None, kn) for kn in parse_knobs(args.knobs) for n in ("bfloat16",) + KV_DTYPES]
        elif (b, ctx) in rows_variant:  # the other scale form, and more warps / stages for the convert
            variants += [(n, scales_on_rows(n), {}) for n in KV_DTYPES]  # fold = True where the default is rows
            variants += [("int8", None, dict(num_warps=8)), ("int8", None, dict(num_stages=3)),
                         ("int8", None, dict(num_stages=4)), ("int8", None, dict(k_major=True)),
                         ("int8", None, dict(k_major=True, num_stages=3)),
                         ("float8_e4m3fn", None, dict(num_stages=3)), ("bfloat16", None, dict(k_major=True))]
        for name, fold, knobs in variants:
            kp, vp, arrays, row = pages_as(name, k, v)
            static = dict(knobs, **({"fold_scales": fold} if arrays and fold is not None else {}))
            label = form_label(name, None if fold is None else not fold) + \
                "".join(f", {kk} {vv}" for kk, vv in knobs.items())
            try:
                t, out = time_decode(args, q, kp, vp, tbl, lens, arrays, static)
            except Exception as exc:  # e.g. a tile past shared memory: report it, time the rest
                log(f"  decode B={b} ctx={ctx} {label}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                rows.append([f"decode B={b} ctx={ctx}", label, "failed", "", "", "", "", ""])
                continue
            out = out[:c].astype(jnp.float32)
            err = rel_err(out, ref)
            # the kernel itself: against the reference on the same (compressed) pages
            kerr = rel_err(out, paged_decode_attention_ref(q[:c], kp, vp, tbl[:c], lens[:c], **arrays).astype(jnp.float32))
            nbytes = 2 * b * ctx * hkv * row
            base = base or t
            rows.append([f"decode B={b} ctx={ctx}", label, f"{t * 1e6:.1f}", f"{nbytes / t / 1e9:.0f}",
                         f"{nbytes / t / bw:.0%}", f"{base / t:.2f}", f"{kerr:.1e}", f"{err:.1e}"])
            log(f"  decode B={b} ctx={ctx} {label}: {t * 1e6:.1f} us ({nbytes / t / bw:.0%} of ceiling), "
                f"kernel err {kerr:.1e}, vs bf16 {err:.1e}")
            del kp, vp, arrays
        log(f"  (shape B={b} ctx={ctx}: {time.perf_counter() - t_shape:.0f} s)")
        del k, v
    if args.shapes:  # only the decode shapes asked for
        table("a. Decode kernel on compressed pages", ["case", "pages", "us", "GB/s", "of ceiling",
              "speed-up vs bf16", "kernel rel err vs its ref", "rel err vs bf16 ref"], rows)
        return write_check(args, hkv, d, s, interp)
    # ragged: one chunk over a long context
    t_new, ctx = (16, 64) if args.quick else (2048, 16384)
    per = (ctx + t_new) // s
    k, v = pages(hkv, per + 1, s, d, jax.random.PRNGKey(9))
    q = jax.random.normal(jax.random.PRNGKey(2), (t_new, hq, d)).astype(jnp.bfloat16)
    tbl = (1 + jnp.arange(per, dtype=jnp.int32))[None]
    cu, kvl = jnp.array([0, t_new], jnp.int32), jnp.array([ctx + t_new], jnp.int32)
    base = None
    # v_rows: V dequantized in registers (16-bit rows into the PV dot) instead of the scales folded;
    # None: the kernel's default for the page dtype, then the other form
    for name, v_rows in [("bfloat16", None)] + [(n, vr) for n in KV_DTYPES for vr in (None, not scales_on_rows(n))]:
        kw, kp, vp = {}, k, v
        if name != "bfloat16":
            (kp, ks), (vp, vs) = quantize_kv(k, jnp.dtype(name)), quantize_kv(v, jnp.dtype(name))
            kw = dict(k_scale=ks, v_scale=vs)
        f = jax.jit(lambda q, kp, vp, kw, v_rows=v_rows: ragged_paged_attention(
            q, kp, vp, tbl, cu, kvl, interpret=interp, v_rows=v_rows, **kw))
        fn = lambda q, f=f, kp=kp, vp=vp, kw=kw: f(q, kp, vp, kw)  # noqa: E731  (pages as arguments)
        t = timeit(lambda: fn(q), 2 if args.quick else 20)
        base = base or t
        flops = 4 * t_new * (ctx + (t_new + 1) / 2) * d * hq
        rows.append([f"ragged {t_new} over {ctx}", form_label(name, v_rows, "V"),
                     f"{t * 1e6:.1f}", f"{flops / t / 1e12:.0f} TFLOP/s", "", f"{base / t:.2f}", "", ""])
    table("a. Kernels on compressed pages (bytes: values + a float32 scale per row; error vs bf16 pages' ref)",
          ["case", "pages", "us", "GB/s", "of ceiling", "speed-up vs bf16", "kernel rel err vs its ref",
           "rel err vs bf16 ref"], rows)
    MD.extend([f"Bandwidth ceiling {bw / 1e9:.0f} GB/s (the larger of a read-only reduction and a copy).  "
               "A compressed row without a named form runs the kernels' default for its dtype "
               "(`pallas_kernels/quant.py` `scales_on_rows`: float8_e4m3fn with its scales on the rows, int8 "
               "folded into scores and probabilities).", ""])
    write_check(args, hkv, d, s, interp)


def parse_knobs(text: str) -> list[dict]:
    """``--knobs "pages_per_block=16;pages_per_block=16,num_stages=3"`` -> one dict of ints per set."""
    return [{k: int(v) for k, v in (kv.split("=") for kv in one.split(","))} for one in text.split(";") if one]


def write_check(args, hkv, d, s, interp):
    """The quantizing KV write: the Pallas kernel against the XLA scatter (bit for bit), and both timed."""
    from pallas_kernels.kv_write import write_kv_quantized, write_kv_quantized_pallas

    n, p = (24, 16) if args.quick else (2048, 4096)
    rows = []
    for name in KV_DTYPES:
        kp, vp = jnp.zeros((hkv, p, s, d), name), jnp.zeros((hkv, p, s, d), name)
        ks, vs = jnp.ones((hkv, p, s), jnp.float32), jnp.ones((hkv, p, s), jnp.float32)
        kn = jax.random.normal(jax.random.PRNGKey(6), (n, hkv, d)) * jnp.where(jnp.arange(d) < 4, 20.0, 1.0)
        vn = jax.random.normal(jax.random.PRNGKey(7), (n, hkv, d))
        kn, vn = kn.astype(jnp.bfloat16), vn.astype(jnp.bfloat16)
        slots = jax.random.permutation(jax.random.PRNGKey(8), p * s)[:n].astype(jnp.int32)
        xla = jax.jit(write_kv_quantized)
        pal = jax.jit(lambda *a: write_kv_quantized_pallas(*a, interpret=interp))
        want, got = xla(kp, vp, ks, vs, kn, vn, slots), pal(kp, vp, ks, vs, kn, vn, slots)
        same = all(bool(jnp.array_equal(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a,
                                        jax.lax.bitcast_convert_type(b, jnp.uint8) if b.dtype.itemsize == 1 else b))
                   for a, b in zip(want, got))
        reps = 3 if args.quick else 50
        t_x = timeit(lambda: xla(kp, vp, ks, vs, kn, vn, slots), reps)
        t_p = timeit(lambda: pal(kp, vp, ks, vs, kn, vn, slots), reps)
        rows.append([name, n, f"{t_p * 1e6:.1f}", f"{t_x * 1e6:.1f}", f"{t_x / t_p:.2f}", "yes" if same else "NO"])
        log(f"  write {n} tokens {name}: pallas {t_p * 1e6:.1f} us, xla {t_x * 1e6:.1f} us, bit-exact {same}")
        if not same:
            FAILURES.append(f"quantizing write kernel ({name}) differs from the XLA scatter")
    table("w. Quantizing KV write (one layer's K and V, scattered slots; the pages are inputs, not donated: "
          "both timed calls include the copy XLA makes of the aliased pages)",
          ["kv dtype", "tokens", "Pallas us", "XLA scatter us", "speed-up", "bit-exact"], rows)
    splice_check(args, hkv, d, s, interp)


def splice_check(args, hkv, d, s, interp):
    """The quantized splice kernel (one layer, N tokens moved with a shift) against its jnp form: time,
    the bytes it moves, and agreement (V bit for bit, K within one code)."""
    from pallas_kernels.quant import quantize_kv
    from pallas_kernels.splice_quantized import splice_kv_quantized, splice_kv_quantized_ref

    n, p = (32, 16) if args.quick else (4096, 2 * 4096 // s + 1)
    inv = 1.0 / (500000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    src = jnp.arange(n, dtype=jnp.int32) + s  # a segment's slots (page 1 on) ...
    dst = src + n  # ... moved right after itself
    shift = jnp.full((n,), 1000, jnp.int32)
    rows = []
    for name in KV_DTYPES:
        k, v = pages(hkv, p, s, d, jax.random.PRNGKey(12))
        (kq, ks), (vq, vs) = quantize_kv(k, jnp.dtype(name)), quantize_kv(v, jnp.dtype(name))
        pal = jax.jit(lambda *a: splice_kv_quantized(*a, interpret=interp))
        ref = jax.jit(splice_kv_quantized_ref)
        got, want = pal(kq, vq, ks, vs, src, dst, shift, inv), ref(kq, vq, ks, vs, src, dst, shift, inv)
        v_same = bool(jnp.array_equal(jax.lax.bitcast_convert_type(got[1], jnp.uint8),
                                      jax.lax.bitcast_convert_type(want[1], jnp.uint8)))
        kd = jnp.abs(got[0].astype(jnp.float32) * got[2][..., None] - want[0].astype(jnp.float32) * want[2][..., None])
        k_err = float(jnp.max(kd) / jnp.max(jnp.abs(want[0].astype(jnp.float32) * want[2][..., None])))
        reps = 3 if args.quick else 50
        t_p = timeit(lambda: pal(kq, vq, ks, vs, src, dst, shift, inv), reps)
        t_r = timeit(lambda: ref(kq, vq, ks, vs, src, dst, shift, inv), reps)
        moved = 2 * 2 * n * hkv * (d + 4)  # K and V rows + scales, read and written
        rows.append([name, n, f"{t_p * 1e6:.1f}", f"{moved / t_p / 1e9:.0f}", f"{t_r * 1e6:.1f}",
                     f"{t_r / t_p:.2f}", "yes" if v_same else "NO", f"{k_err:.1e}"])
        log(f"  splice {n} tokens {name}: pallas {t_p * 1e6:.1f} us, jnp {t_r * 1e6:.1f} us, V same {v_same}, "
            f"K max diff {k_err:.1e}")
        if not v_same:
            FAILURES.append(f"quantized splice kernel ({name}): V rows differ from the jnp form")
    table("sp. Quantized splice with a RoPE shift (one layer; the pages are inputs, not donated: the "
          "timed calls include the copy XLA makes of the aliased pages)",
          ["kv dtype", "tokens", "Pallas us", "GB/s moved", "jnp us", "speed-up", "V bit-exact",
           "K max diff (rel)"], rows)


@section
def v_layout(args):
    """Section v: V pages token-contiguous ([Hkv, P, D, S], one page per block) against the usual layout at
    the same page size: does a 1-byte V operand contiguous along the PV dot's contraction close the gap?"""
    from pallas_kernels.decode_attention import paged_decode_attention_ref

    hq, hkv, d = (8, 2, 16) if args.quick else (32, 8, 128)
    bw = R.get("bw") or ceiling(args.quick)
    shapes = [(4, 128)] if args.quick else [(32, 16384), (128, 4096)]
    page_sizes = (16, 32) if args.quick else (64, 128)
    rows = []
    for b, ctx in shapes:
        for s in page_sizes:
            q, k, v, tbl, lens = decode_case(b, ctx, hq, hkv, s, d, seed=b + ctx + s)
            c = min(b, 8)
            base = None
            for name in ("bfloat16",) + KV_DTYPES:
                kp, vp, arrays, row = pages_as(name, k, v)
                own = paged_decode_attention_ref(q[:c], kp, vp, tbl[:c], lens[:c], **arrays).astype(jnp.float32)
                for vt, knobs in ((False, {}), (True, {}), (True, dict(num_stages=3))):
                    vin = jnp.swapaxes(vp, -1, -2) if vt else vp
                    static = dict(pages_per_block=1, v_transposed=vt, **knobs)
                    try:
                        t, out = time_decode(args, q, kp, vin, tbl, lens, arrays, static)
                        out = out[:c].astype(jnp.float32)
                    except Exception as exc:  # a lowering gap on the GPU: report it, keep the others
                        log(f"  v layout B={b} ctx={ctx} S={s} {name} vt={vt}: FAILED {type(exc).__name__}: {exc}"[:600])
                        FAILURES.append(f"section v: {name} S={s} v_transposed={vt} failed")
                        continue
                    kerr = rel_err(out, own)
                    nbytes = 2 * b * ctx * hkv * row
                    base = base or t
                    label = f"{name}, V {'[D, S]' if vt else '[S, D]'}" + "".join(f", {kk} {vv}" for kk, vv in knobs.items())
                    rows.append([f"B={b} ctx={ctx} page {s}", label, f"{t * 1e6:.1f}", f"{nbytes / t / 1e9:.0f}",
                                 f"{nbytes / t / bw:.0%}", f"{base / t:.2f}", f"{kerr:.1e}"])
                    log(f"  v layout B={b} ctx={ctx} S={s} {label}: {t * 1e6:.1f} us ({nbytes / t / bw:.0%}), err {kerr:.1e}")
            del k, v
    table("v. V layout on compressed pages: token-contiguous V pages ([D, S] per page) vs the usual [S, D], one "
          "page per block (decode kernel, 32 q / 8 kv heads, d=128)",
          ["shape", "pages", "us", "GB/s", "of ceiling", "speed-up vs bf16 [S, D]", "kernel rel err vs its ref"], rows)


def kl_and_agreement(ref, out):
    """(greedy agreement fraction, mean KL over the shared prefix) from two outputs' top-k logprobs."""
    n = len(ref.token_ids)
    agree = next((i for i, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b), n)
    kls = []
    for i in range(min(agree + 1, n)):
        p, q = ref.logprobs[i], out.logprobs[i]
        keys = [t for t in p if t in q]
        if not keys:
            continue
        # both distributions renormalised over the tokens in both top-20s: a proper KL (>= 0)
        lp = np.array([p[t] for t in keys])
        lq = np.array([q[t] for t in keys])
        lp, lq = lp - np.logaddexp.reduce(lp), lq - np.logaddexp.reduce(lq)
        kls.append(float(np.sum(np.exp(lp) * (lp - lq))))
    return agree / n, float(np.mean(kls)) if kls else math.nan


MODES_L = {True: 64, False: 1024}  # section c: each of the 3 segments


def quality_lengths(args) -> list[int]:
    return [int(x) for x in args.lengths.split(",")] if args.lengths else [128, 256] if args.quick else [1024, 4096, 8192]


def quality_pages(args) -> int:
    """One pool size for every engine of sections b and c (the longest case with room to spare), so
    their step shapes - and compiled programs - are shared across lengths and KV dtypes."""
    longest = max(max(quality_lengths(args)), 3 * MODES_L[args.quick]) + 256
    return 1 + 2 * -(-longest // 16)


@section
def quality(args):
    from inferscale_jax import Engine, EngineConfig, SamplingParams

    cfg, params = model_for(args)
    n_out = 16 if args.quick else 128
    Ls = quality_lengths(args)
    sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True, logprobs=20)
    rng = np.random.default_rng(0)
    rows = []
    for L in Ls:
        room = cfg.max_position_embeddings - 32 - n_out  # the segment, the question and the output fit
        if L > room:
            log(f"  L={L} leaves no room for the question and {n_out} tokens within the model's "
                f"{cfg.max_position_embeddings} positions: L={room} instead")
            L = room
        seg, q = text_tokens(args, cfg, rng, L), text_tokens(args, cfg, rng, 32)
        outs = {}
        for name in (None,) + KV_DTYPES:
            e = Engine(params, cfg, None, EngineConfig(dtype="bfloat16", page_size=16, kv_dtype=name,
                                                       hbm_pages=quality_pages(args), prefill_chunk=512,
                                                       max_batch=8, attention_impl=args.attention_impl))
            e.register_segment("s", token_ids=seg)
            outs[name] = e.generate(prompt_token_ids=q, segments=["s"], sampling=sp)
            del e
        for name in KV_DTYPES:
            agree, kl = kl_and_agreement(outs[None], outs[name])
            rows.append([L, name, f"{agree:.2f}", f"{kl:.2e}"])
            log(f"  L={L} {name}: greedy agreement {agree:.2f}, mean KL {kl:.2e}")
    table(f"b. End to end vs bf16 KV ({'model ' + args.model if args.model else 'random weights, a small shape'}): "
          f"a segment of L tokens injected + 32-token question, {n_out} greedy tokens",
          ["L", "kv dtype", "greedy agreement", "mean KL (top-20)"], rows)


@section
def modes_quality(args):
    """c. compose / blend vs exact on 3 segments, per KV dtype (the quality table never measured
    before): greedy agreement and KL against exact with the model's-dtype KV."""
    from inferscale_jax import Engine, EngineConfig, SamplingParams

    cfg, params = model_for(args)
    n_out = 16 if args.quick else 128
    L = MODES_L[args.quick]
    sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True, logprobs=20)
    rng = np.random.default_rng(3)
    segs = [text_tokens(args, cfg, rng, L) for _ in range(3)]
    q = text_tokens(args, cfg, rng, 32)
    rows, ref = [], None
    for kv in (None,) + KV_DTYPES:
        e = Engine(params, cfg, None, EngineConfig(dtype="bfloat16", page_size=16, kv_dtype=kv,
                                                   hbm_pages=quality_pages(args), prefill_chunk=512,
                                                   max_batch=8, attention_impl=args.attention_impl))
        for i, sg in enumerate(segs):
            e.register_segment(f"s{i}", token_ids=sg)
        for mode in ("exact", "compose", "blend"):
            out = e.generate(prompt_token_ids=q, segments=["s0", "s1", "s2"], sampling=sp, mode=mode)
            if ref is None:
                ref = out
                continue
            agree, kl = kl_and_agreement(ref, out)
            rows.append([kv or "bfloat16", mode, f"{agree:.2f}", f"{kl:.2e}"])
        del e
    table(f"c. Injection modes vs exact with bf16 KV: 3 segments of {L} + a 32-token question, {n_out} greedy tokens",
          ["kv dtype", "mode", "greedy agreement", "mean KL (top-20)"], rows)


@section
def splice_error(args):
    """s. The quantized splice's added error: a key spliced with a RoPE shift is dequantized, rotated and
    quantized again (``pallas_kernels/splice_quantized.py``).  Against the exact rotated key, the relative
    RMS error of (1) quantizing the rotated key once (what a segment computed at its final place holds)
    and (2) the splice's second rounding; on random keys with outlier channels and, with ``--model``, the
    real keys of every layer for a segment of held-out text."""
    from pallas_kernels.quant import dequantize_kv, quantize_kv
    from pallas_kernels.splice import rope_rotate_ref

    sources = []
    d = 16 if args.quick else 128
    kr = jax.random.normal(jax.random.PRNGKey(5), (8, 512, d)) * jnp.where(jnp.arange(d) < 4, 20.0, 1.0)
    sources.append(("random, 4 outlier channels x20", kr, 10000.0))
    if args.model:
        from inferscale_jax import Engine, EngineConfig

        cfg, params = model_for(args)
        e = Engine(params, cfg, None, EngineConfig(dtype="bfloat16", page_size=16, hbm_pages=1 + 1024 // 16 * 2,
                                                   prefill_chunk=512, max_batch=8, attention_impl=args.attention_impl))
        e.register_segment("s", token_ids=text_tokens(args, cfg, np.random.default_rng(7), 512))
        pages = jnp.asarray(e.store.node([e.store.resolve("s", "default")]).pages, jnp.int32)
        ks = [e.runner.cache.k[i][:, pages].reshape(cfg.num_kv_heads, -1, cfg.head_dim)
              for i in range(cfg.num_layers)]
        sources.append((f"{os.path.basename(args.model.rstrip('/'))}: K of {cfg.num_layers} layers, 512 tokens",
                        jnp.concatenate(ks, axis=0).astype(jnp.float32), cfg.rope.theta))
        e.close()
    rows = []
    for label, x, theta in sources:
        dd = x.shape[-1]
        inv = 1.0 / (theta ** (jnp.arange(0, dd, 2, dtype=jnp.float32) / dd))
        ratio_max = 0.0
        for shift in (1, 64, 1024):
            sh = jnp.full((x.shape[-2],), shift, jnp.int32)
            exact = rope_rotate_ref(x, sh, inv)
            norm = float(jnp.sqrt(jnp.mean(exact ** 2)))
            for name in KV_DTYPES:
                dt = jnp.dtype(name)
                once = dequantize_kv(*quantize_kv(exact, dt), jnp.float32)
                q0 = dequantize_kv(*quantize_kv(x, dt), jnp.float32)
                twice = dequantize_kv(*quantize_kv(rope_rotate_ref(q0, sh, inv), dt), jnp.float32)
                e1 = float(jnp.sqrt(jnp.mean((once - exact) ** 2))) / norm
                e2 = float(jnp.sqrt(jnp.mean((twice - exact) ** 2))) / norm
                ratio_max = max(ratio_max, e2 / e1)
                rows.append([label, shift, name, f"{e1:.2e}", f"{e2:.2e}", f"{e2 / e1:.2f}"])
                log(f"  {label} shift {shift} {name}: once {e1:.2e}, spliced {e2:.2e} ({e2 / e1:.2f}x)")
    table("s. The quantized splice's added error (relative RMS against the exact rotated key)",
          ["keys", "shift", "kv dtype", "quantized once (at the final place)", "spliced (quantized, rotated, "
           "quantized again)", "ratio"], rows)
    MD.extend(["Two independent roundings of similar size would give a ratio near sqrt(2) = 1.41.", ""])


_TEXT: list = []


def text_tokens(args, cfg, rng, n: int) -> list[int]:
    """``n`` tokens of content: with ``--model``, a random window of English text (the documentation
    ``bench/tools/train_small_lm.py`` trains on, tokenized by the model's tokenizer: real context for a
    trained model), from the documents it held out (``--corpus-mb`` as in its training); with random
    weights, random token ids."""
    if not args.model:
        return rng.integers(0, cfg.vocab_size, n).tolist()
    if not _TEXT:
        sys.path.insert(0, os.path.join(ROOT, "bench", "tools"))
        from train_small_lm import corpus  # bench/tools/train_small_lm.py
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        docs = corpus(int(args.corpus_mb * 2**20))
        np.random.default_rng(0).shuffle(docs)  # as train_small_lm.py does: its held-out documents
        _TEXT.extend(tok("\n\n".join(docs[: max(1, len(docs) // 50)]))["input_ids"])
    at = int(rng.integers(0, len(_TEXT) - n))
    return list(_TEXT[at:at + n])


def model_for(args):
    """(config, bf16 params): the --model checkpoint, or random weights of a small shape."""
    from models import ModelConfig, init_params

    if args.model:
        from models import load_params
        cfg = ModelConfig.from_pretrained(args.model)
        return cfg, load_params(args.model, cfg, jnp.bfloat16)
    from common import model_config
    sh = dict(vocab=4096, hidden=256, inter=768, layers=4, heads=8, kv=2, head_dim=32, theta=500000.0,
              max_pos=16384, eps=1e-5)
    cfg = model_config(sh)
    return cfg, init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16, scale=0.05)


def main():
    ap = parser(__doc__, "tiny shapes (CPU: interpret mode)")
    ap.add_argument("--sections", default="abc")
    ap.add_argument("--model", default=None, help="sections b, c: an HF checkpoint folder (default: random weights)")
    ap.add_argument("--lengths", default=None, help="section b: segment lengths, e.g. 512,1024,2048")
    ap.add_argument("--corpus-mb", type=float, default=24.0, help="--model: its training's --corpus-mb")
    ap.add_argument("--shapes", default=None, help="section a: only these decode shapes, BxCTX comma separated "
                                                    "(e.g. 32x16384,32x32768), and the write check")
    ap.add_argument("--knobs", default=None, help="section a: decode kernel knob sets to time on every page dtype "
                                                   "instead of the built-in variants, e.g. 'pages_per_block=16;num_stages=3'")
    ap.add_argument("--attention-impl", default="auto", choices=["auto", "pallas", "ref"],
                    help="sections b, c: EngineConfig.attention_impl (ref: the jnp references, to tell the "
                         "kernels' error from the quantization's)")
    ap.add_argument("--name", default="kv_dtype.md", help="the report's file name in --out")
    args = ap.parse_args()
    plan = [("a", kernels), ("b", quality), ("c", modes_quality), ("s", splice_error), ("v", v_layout)]
    return run_sections(args, plan, lambda a, t0: finish(a.out, a.name, "Compressed KV benchmark", t0, ROOT))


if __name__ == "__main__":
    sys.exit(main())
