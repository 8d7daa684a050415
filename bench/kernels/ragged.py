"""GPU benchmark of ragged paged attention (one flat token batch: decode rows + prefill chunks).

Usage (from the repository root)::

    python bench/kernels/ragged.py --out bench/results          # full run on an H200, a few minutes
    python bench/kernels/ragged.py --quick --out /tmp/rq        # tiny shapes, also on CPU (interpret)
    python bench/kernels/ragged.py --sections '' --tune --out DIR   # knob sweep only (48 compiles)

Sections (each guarded: a failure prints its traceback and the run goes on):

0. Correctness on the device: random mixed steps (decode rows, chunks of ragged lengths,
   empty rows, padding tokens, a NaN-poisoned pool), bf16 32/8 and 24/8 heads (G = 3), fp32,
   split-KV forced, against ``ragged_paged_attention_ref``; padding tokens must be exact zeros.
1. Pure prefill chunk, B=1, chunk {512, 2048} over {4096, 16384} cached, 32 q / 8 kv heads,
   d=128, page 16, bf16: ragged vs ``paged_prefill_attention`` vs cuDNN flash attention
   (``jax.nn.dot_product_attention(implementation="cudnn")``) on the same useful work:
   (a) the dense problem with a boolean mask for the bottom-right causal tail (as
   bench/kernels/kernels.py section c), (b) "2-part": cuDNN without mask over the cached keys plus
   cuDNN's native causal kernel over the chunk's own keys (two calls, the softmax merge not
   counted: a lower bound of cuDNN's time for this work), (c) no mask over all keys (a bound
   that does more work).  TFLOP/s count useful work only: ``4 T (C + (T + 1) / 2) D Hq``.
2. Pure decode rows: R in {1, 64, 256} rows over 4096 tokens: ragged vs
   ``paged_decode_attention``; effective bandwidth counts K + V read once.
3. Mixed step: 63 decode rows over 4k + one 512-token chunk over 4k, and 255 + one 2048:
   ragged in one call vs the decode kernel + the prefill kernel timed apart (sum), and both
   apart inside one jit (what an engine without the ragged kernel would run).
4. Split-KV forms: the engine's C = 64 mixed step (61 decode rows + a 64-token question over its own keys),
   the same with the chunk over 16k private keys, a lone 64-token question over 4k / 16k (C = 1): the
   automatic split count for every block (``split_longest=False``), unsplit, and ``split_longest`` (the
   default: only the blocks that see the most keys split); speed = every-block-split's time / the form's; the
   GPU's kernel time of each form beside it (the profiler's: no launch gaps, ``kernels.time_calls_and_device``).
5. The small (decode-row) tile's keys per step and stages (``small_block_kv``, ``num_stages``) on the served loop's
   mixed steps at C = 256 / 64 and a 256-row decode-shaped step, then the decode kernel's block (128 / 64 / 32 keys)
   on that one: the small tile's shared memory bounds the programs an SM holds.

Timing as bench/kernels/kernels.py: every measurement jit-compiles R calls on R different input sets
(separate pages, so XLA cannot merge them and K/V rotate through more memory than L2), then
the median over repetitions of the whole executable divided by R.  Ratios are speed ratios
(time of the other / time of ragged: > 1 means ragged is faster).  Writes ``ragged.md`` and
``ragged.png`` (bar chart of the ratios) into ``--out``; exits non-zero if a check failed.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)
from kernels import check, fits, time_calls, time_calls_and_device  # noqa: E402
from report import FAILURES, MD, code_version, log, pyplot, save_plot, section, table, write_md  # noqa: E402
from sections import parser, run_sections  # noqa: E402  (bench/lib/sections.py)
from pallas_kernels.decode_attention import paged_decode_attention  # noqa: E402
from pallas_kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from pallas_kernels.ragged_attention import (  # noqa: E402
    ragged_paged_attention, ragged_paged_attention_ref)

DT = jnp.bfloat16
HQ, HKV, D, S = 32, 8, 128, 16
PLOT: list = []  # (group, label, speed ratio)


# ---------------------------------------------------------------- inputs

def make_steps(rows, *, pad=0, nv=1, hq=HQ, hkv=HKV, dtype=DT, seed=0, poison=False):
    """``nv`` random input sets of one ragged step over one shared page pool.

    ``rows``: list of (q_len, cached).  Each set has its own pages (scattered at random, never
    the null page 0) and queries.  Returns (k_pages, v_pages, [(q, table, cu, kv_lens)]).
    ``poison``: slots that hold no token and the padding tokens of q are NaN."""
    rng = np.random.default_rng(seed)
    q_lens = np.array([r[0] for r in rows], np.int32)
    kv = q_lens + np.array([r[1] for r in rows], np.int32)
    need = -(-kv // S)
    max_pages = max(1, int(need.max()))
    per_set = int(need.sum())
    num_pages = 1 + nv * per_set
    perm = rng.permutation(np.arange(1, num_pages))
    key = jax.random.PRNGKey(seed)

    @jax.jit
    def pool(k):  # one [P, S, D] head at a time: no huge fp32 temporaries
        return jax.lax.map(lambda kk: jax.random.normal(kk, (num_pages, S, D), jnp.float32)
                           .astype(dtype), jax.random.split(k, hkv))

    kp, vp = pool(jax.random.fold_in(key, 1)), pool(jax.random.fold_in(key, 2))
    valid = np.zeros((num_pages, S), bool)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    n_real = int(q_lens.sum())
    sets = []
    for i in range(nv):
        ids = perm[i * per_set:(i + 1) * per_set]
        tb = np.zeros((len(rows), max_pages), np.int32)
        off = 0
        for r, n in enumerate(need):
            tb[r, :n] = ids[off:off + n]
            off += n
            pos = np.arange(kv[r])
            valid[tb[r, pos // S], pos % S] = True
        q = jax.random.normal(jax.random.fold_in(key, 10 + i), (n_real + pad, hq, D),
                              jnp.float32).astype(dtype)
        if poison:
            q = q.at[n_real:].set(jnp.nan)
        sets.append((q, jnp.asarray(tb), cu, jnp.asarray(kv)))
    if poison:
        ok = jnp.asarray(valid)[None, :, :, None]
        kp, vp = jnp.where(ok, kp, jnp.nan), jnp.where(ok, vp, jnp.nan)
    return kp, vp, sets


def ragged_call(interpret, **kw):
    fn = functools.partial(ragged_paged_attention, interpret=interpret, **kw)
    return lambda kp, vp, q, table, cu, kv: fn(q, kp, vp, table, cu, kv)


def speed(t_other, t_ours):
    return t_other / t_ours if t_other and t_ours else None


def fx(x, fmt="{:.2f}x"):
    return fmt.format(x) if x is not None else "n/a"


def us(sec):
    return f"{sec * 1e6:.1f}" if sec else "n/a"


# ---------------------------------------------------------------- 0. correctness

@section
def correctness(args):
    rng = np.random.default_rng(0)
    ctx_max = 200 if args.quick else 3000
    n_rows = 6 if args.quick else 40
    rows = [(int(rng.choice([0, 1, 1, 1, 3, 17, 40 if args.quick else 300])),
             int(rng.integers(0, ctx_max))) for _ in range(n_rows)]
    hq, hkv = (4, 2) if args.quick else (HQ, HKV)
    cases = [("bf16", DT, hq, hkv, {}), ("bf16 kv_splits=3", DT, hq, hkv, dict(kv_splits=3)),
             ("bf16 G=3", DT, 3 * hkv, hkv, {}), ("fp32", jnp.float32, hq, hkv, {})]
    out_rows = []
    for name, dtype, h_q, h_kv, kw in cases:
        kp, vp, sets = make_steps(rows, pad=37, hq=h_q, hkv=h_kv, dtype=dtype, seed=len(name),
                                  poison=True)
        q, tb, cu, kv = sets[0]
        out = jax.jit(ragged_call(args.interpret, **kw))(kp, vp, q, tb, cu, kv)
        ref = ragged_paged_attention_ref(q, kp, vp, tb, cu, kv)
        n = int(cu[-1])
        pad_ok = bool((np.asarray(out[n:], np.float32) == 0).all())
        if not pad_ok:
            FAILURES.append(f"correctness {name}: padding tokens not zero")
        err = check(f"ragged {name} vs ref", out[:n], ref[:n], tol=2e-2 if dtype == DT else 1e-4)
        out_rows.append([name, f"{h_q}/{h_kv}", len(rows), q.shape[0], f"{err:.1e}",
                         "ok" if pad_ok else "FAIL"])
        del kp, vp, sets
    table("0. Correctness on the device (random mixed steps: q_len in {0,1,3,17,300}, "
          "NaN-poisoned pool, 37 padding tokens)",
          ["case", "heads", "rows", "tokens", "rel err", "padding zeros"], out_rows)


# ---------------------------------------------------------------- 1. prefill

@section
def prefill(args):
    hq, hkv = (4, 2) if args.quick else (HQ, HKV)
    chunks, cached_list = ([16, 32], [64]) if args.quick else ([512, 2048], [4096, 16384])
    nv = 2 if args.quick else 4
    rows = []
    for cached in cached_list:
        for t in chunks:
            total = cached + t
            kp, vp, sets = make_steps([(t, cached)], nv=nv, hq=hq, hkv=hkv, seed=t + cached)
            t_rag, outs = time_calls(ragged_call(args.interpret), (kp, vp), sets, args.reps)
            pre = functools.partial(paged_prefill_attention, interpret=args.interpret)
            t_pre, pouts = time_calls(
                lambda kp, vp, q, tb, cu, kv: pre(q[None], kp, vp, tb, cu[1:], kv),
                (kp, vp), sets, args.reps)
            q0, tb0, cu0, kv0 = sets[0]
            err = check(f"prefill T={t} C={cached}: ragged vs ref", outs[0],
                        ragged_paged_attention_ref(q0, kp, vp, tb0, cu0, kv0))
            check(f"prefill T={t} C={cached}: prefill kernel vs ragged", pouts[0][0], outs[0])
            # dense copies for cuDNN: [1, S_kv, Hkv, D] gathered from the same pages
            dense = []
            for q, tb, _, _ in sets:
                slots = (tb[0][:, None] * S + jnp.arange(S)).reshape(-1)[:total]
                k = kp.reshape(hkv, -1, D)[:, slots].transpose(1, 0, 2)[None]
                v = vp.reshape(hkv, -1, D)[:, slots].transpose(1, 0, 2)[None]
                dense.append((q[None], k, v))
            mask = (jnp.arange(total)[None, :] <= cached + jnp.arange(t)[:, None])[None, None]
            dpa = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
            t_mask = t_two = t_full = None
            try:
                t_mask, couts = time_calls(lambda m, q, k, v: dpa(q, k, v, mask=m), (mask,),
                                           dense, args.reps)
                check(f"prefill T={t} C={cached}: cudnn+mask vs ragged", couts[0][0], outs[0])
                t_two, _ = time_calls(lambda q, k, v: (
                    dpa(q, k[:, :cached], v[:, :cached]),
                    dpa(q, k[:, cached:], v[:, cached:], is_causal=True)), (), dense, args.reps)
                t_full, _ = time_calls(lambda q, k, v: dpa(q, k, v), (), dense, args.reps)
            except Exception as e:  # noqa: BLE001
                log(f"  cudnn T={t} C={cached} failed: {str(e).splitlines()[0][:200]}")
            flops = 4 * t * (cached + (t + 1) / 2) * D * hq

            def tf(sec):
                return f"{flops / sec / 1e12:.0f}" if sec else "n/a"

            r_mask, r_two, r_pre = speed(t_mask, t_rag), speed(t_two, t_rag), speed(t_pre, t_rag)
            rows.append([t, cached, us(t_rag), tf(t_rag), f"{err:.1e}", us(t_pre), fx(r_pre),
                         us(t_mask), fx(r_mask), us(t_two), fx(r_two), us(t_full), tf(t_full)])
            for label, r in (("vs cuDNN+mask", r_mask), ("vs cuDNN 2-part", r_two),
                             ("vs prefill kernel", r_pre)):
                if r is not None:
                    PLOT.append(("prefill", f"T={t} C={cached} {label}", r))
            log(f"  T={t} C={cached}: ragged {us(t_rag)} us, prefill {us(t_pre)} us, "
                f"cudnn+mask {us(t_mask)} us, cudnn 2-part {us(t_two)} us")
            del kp, vp, sets, dense
    table(f"1. Pure prefill chunk (B=1, {hq}/{hkv} heads, d=128, page 16, bf16; TFLOP/s of "
          "useful work; speed ratios = other time / ragged time)",
          ["chunk", "cached", "ragged us", "TFLOP/s", "rel err", "prefill kernel us",
           "ragged speed vs prefill", "cuDNN+mask us", "ragged speed vs cuDNN+mask",
           "cuDNN 2-part us", "ragged speed vs 2-part", "cuDNN no-mask us",
           "no-mask TFLOP/s"], rows)


# ---------------------------------------------------------------- 2. decode

@section
def decode(args):
    hq, hkv = (4, 2) if args.quick else (HQ, HKV)
    batches, ctx = ([1, 4], 64) if args.quick else ([1, 64, 256], 4096)
    rows = []
    for r in batches:
        kv_bytes = 2 * r * ctx * hkv * D * 2
        nv = 2 if args.quick else int(np.clip(2e9 / kv_bytes, 4, 16))
        if not fits(nv * kv_bytes + 2**28):
            nv = 2
        kp, vp, sets = make_steps([(1, ctx - 1)] * r, nv=nv, hq=hq, hkv=hkv, seed=r)
        t_rag, outs = time_calls(ragged_call(args.interpret), (kp, vp), sets, args.reps)
        t_dec, douts = time_calls(_decode_call(args.interpret, {}), (kp, vp), sets, args.reps)
        q0, tb0, cu0, kv0 = sets[0]
        err = check(f"decode R={r}: ragged vs ref", outs[0],
                    ragged_paged_attention_ref(q0, kp, vp, tb0, cu0, kv0))
        check(f"decode R={r}: decode kernel vs ragged", douts[0], outs[0])
        ratio = speed(t_dec, t_rag)
        rows.append([r, ctx, us(t_rag), f"{kv_bytes / t_rag / 1e9:.0f}", f"{err:.1e}",
                     us(t_dec), f"{kv_bytes / t_dec / 1e9:.0f}", fx(ratio)])
        PLOT.append(("decode", f"R={r} ctx={ctx} vs decode kernel", ratio))
        log(f"  R={r}: ragged {us(t_rag)} us, decode kernel {us(t_dec)} us")
        del kp, vp, sets
    table(f"2. Pure decode rows ({hq}/{hkv} heads, d=128, page 16, bf16; GB/s = K+V bytes / "
          "time)", ["rows", "ctx", "ragged us", "ragged GB/s", "rel err", "decode kernel us",
                    "decode GB/s", "ragged speed vs decode"], rows)


# ---------------------------------------------------------------- 3. mixed

def _mixed_shapes(quick):
    if quick:
        return [(3, 64, 16, 64)]
    return [(63, 4096, 512, 4096), (255, 4096, 2048, 4096)]


@section
def mixed(args):
    hq, hkv = (4, 2) if args.quick else (HQ, HKV)
    rows = []
    for n_dec, ctx, t, cached in _mixed_shapes(args.quick):
        nv = 2 if args.quick else 4
        kp, vp, sets = make_steps([(1, ctx - 1)] * n_dec + [(t, cached)], nv=nv, hq=hq,
                                  hkv=hkv, seed=n_dec + t)
        t_rag, outs = time_calls(ragged_call(args.interpret), (kp, vp), sets, args.reps)
        dec = functools.partial(paged_decode_attention, interpret=args.interpret)
        pre = functools.partial(paged_prefill_attention, interpret=args.interpret)

        def dec_part(kp, vp, q, tb, cu, kv):
            return dec(q[:n_dec], kp, vp, tb[:n_dec], kv[:n_dec])

        def pre_part(kp, vp, q, tb, cu, kv):
            return pre(q[None, n_dec:], kp, vp, tb[n_dec:], cu[-1:] - cu[-2:-1], kv[n_dec:])

        t_dec, douts = time_calls(dec_part, (kp, vp), sets, args.reps)
        t_pre, pouts = time_calls(pre_part, (kp, vp), sets, args.reps)
        t_both, _ = time_calls(lambda *a: (dec_part(*a), pre_part(*a)), (kp, vp), sets,
                               args.reps)
        q0, tb0, cu0, kv0 = sets[0]
        name = f"mixed {n_dec} decode + {t} chunk"
        err = check(f"{name}: ragged vs ref", outs[0],
                    ragged_paged_attention_ref(q0, kp, vp, tb0, cu0, kv0))
        check(f"{name}: kernels apart vs ragged", jnp.concatenate([douts[0], pouts[0][0]]),
              outs[0])
        r_sum, r_both = speed(t_dec + t_pre, t_rag), speed(t_both, t_rag)
        rows.append([f"{n_dec} x 1 over {ctx}", f"{t} over {cached}", us(t_rag), f"{err:.1e}",
                     us(t_dec), us(t_pre), us(t_dec + t_pre), fx(r_sum), us(t_both), fx(r_both)])
        PLOT.append(("mixed", f"{n_dec}+{t} vs apart (sum)", r_sum))
        PLOT.append(("mixed", f"{n_dec}+{t} vs apart (one jit)", r_both))
        log(f"  {name}: ragged {us(t_rag)} us, decode {us(t_dec)} + prefill {us(t_pre)} us")
        del kp, vp, sets
    table(f"3. Mixed step ({hq}/{hkv} heads, d=128, page 16, bf16): ragged in one call vs the "
          "decode and prefill kernels apart",
          ["decode rows", "chunk", "ragged us", "rel err", "decode kernel us",
           "prefill kernel us", "sum us", "ragged speed vs sum", "both in one jit us",
           "ragged speed vs one jit"], rows)


# ---------------------------------------------------------------- 4. split-KV forms

def _split_shapes(quick):
    """(name, rows, padding tokens): the engine's C = 64 mixed step (61 decode rows of ~100 private keys
    and a 64-token question whose segment the cascade reads: its own keys only), the same beside one
    64-token chunk over a long private context, and a lone question over 4k / 16k private keys (C = 1)."""
    if quick:
        return [("rows + question", [(1, 12)] * 5 + [(8, 0)], 3), ("rows + long chunk", [(1, 12)] * 5 + [(8, 700)], 3),
                ("lone question", [(8, 700)], 0)]
    return [("61 rows + question (C = 64 mixed)", [(1, 100)] * 61 + [(64, 0)], 3),
            ("61 rows + chunk over 16k", [(1, 100)] * 61 + [(64, 16384)], 3),
            ("lone question over 4k (C = 1)", [(64, 4096)], 0),
            ("lone question over 16k", [(64, 16384)], 0)]


SPLIT_FORMS = [("every block split (split_longest=False)", dict(split_longest=False)),
               ("unsplit (kv_splits=1)", dict(kv_splits=1)), ("split_longest (default)", {})]


@section
def splits(args):
    """Split-KV forms of the same steps: the automatic count for every block, none, and only the blocks
    that see the most keys (``split_longest``, the default); each checked against the reference."""
    hq, hkv = (4, 2) if args.quick else (HQ, HKV)
    rows = []
    for name, shape, pad in _split_shapes(args.quick):
        kp, vp, sets = make_steps(shape, pad=pad, nv=2 if args.quick else 4, hq=hq, hkv=hkv, seed=len(shape) + pad)
        q0, tb0, cu0, kv0 = sets[0]
        ref = ragged_paged_attention_ref(q0, kp, vp, tb0, cu0, kv0)
        n = int(cu0[-1])
        times, dev = [], []
        for label, kw in SPLIT_FORMS:
            kw = dict(kw, kv_splits=kw.get("kv_splits", 3)) if args.interpret and "kv_splits" not in kw else kw
            t, outs, t_dev, _ = time_calls_and_device(ragged_call(args.interpret, **kw), (kp, vp), sets, args.reps)
            check(f"{name} {label} vs ref", outs[0][:n], ref[:n])
            times.append(t)
            dev.append(t_dev)
        rows.append([name, q0.shape[0], len(shape)] + [us(t) for t in times]
                    + [fx(speed(times[0], t)) for t in times[1:]]
                    + ["" if d != d else us(d) for d in dev])  # (NaN off the GPU: no profiler times)
        for (label, _), t in zip(SPLIT_FORMS[1:], times[1:]):
            PLOT.append(("splits", f"{name}: {label} vs every block split", speed(times[0], t)))
        log(f"  {name}: " + ", ".join(f"{lab} {us(t)} us" for (lab, _), t in zip(SPLIT_FORMS, times)))
        del kp, vp, sets
    table(f"4. Split-KV forms ({hq}/{hkv} heads, d=128, page 16, bf16; speed = every-block-split's time / the form's)",
          ["step", "tokens", "rows"] + [f"{lab} us" for lab, _ in SPLIT_FORMS]
          + [f"{lab} speed vs every block split" for lab, _ in SPLIT_FORMS[1:]]
          + [f"{lab}: GPU kernel us" for lab, _ in SPLIT_FORMS], rows)


# ---------------------------------------------------------------- 5. the small tile's keys

def _small_shapes(quick):
    """(name, rows, padding tokens): the served loop's mixed steps (decode rows of ~100 private keys, whose segment
    the cascade reads, beside 64-token questions over their own keys only) and a decode-shaped step."""
    if quick:
        return [("rows + question", [(1, 40)] * 6 + [(8, 0)], 2), ("decode rows", [(1, 40)] * 8, 0)]
    return [("C = 256 mixed: 250 rows + 3 questions", [(1, 96)] * 250 + [(64, 0)] * 3, 70),
            ("C = 64 mixed: 61 rows + a question", [(1, 100)] * 61 + [(64, 0)], 3),
            ("256 decode rows (decode-shaped)", [(1, 100)] * 256, 0),
            ("C = 256 cohort: 28 questions + 200 rows", [(64, 0)] * 28 + [(1, 100)] * 200, 56),
            ("lone question over 4k (C = 1)", [(64, 4096)], 0),
            ("a 2048-token chunk over 2k cached", [(2048, 2048)], 0)]


SMALL_FORMS = [("default", {}), ("sk=64", dict(small_block_kv=64)), ("sk=32", dict(small_block_kv=32)),
               ("sk=64, 3 stages", dict(small_block_kv=64, num_stages=3)), ("1 stage", dict(num_stages=1)),
               ("1 stage, sk=64", dict(num_stages=1, small_block_kv=64)),
               ("1 stage, sk=256", dict(num_stages=1, small_block_kv=256)),
               ("1 stage, 8 warps", dict(num_stages=1, num_warps=8))]
DECODE_FORMS = [("decode kernel, 128 keys a step (default)", {}), ("decode kernel, 64", dict(pages_per_block=4)),
                ("decode kernel, 32", dict(pages_per_block=2)), ("decode kernel, 1 stage", dict(num_stages=1))]


@section
def small_tile(args):
    """The decode rows' (small) tile by keys per step (``small_block_kv``) and stages: its shared memory is
    stages x 2 x keys x D x 2 bytes (128 KB at the default 128 keys and 2 stages), which bounds the programs an
    SM holds while each decode row's program reads only one or two tiles; then the decode kernel by its block."""
    hq, hkv = (4, 2) if args.quick else (HQ, HKV)
    forms = SMALL_FORMS[:2] if args.quick else SMALL_FORMS
    forms = [forms[int(i)] for i in args.small_forms.split(",")] if args.small_forms else forms
    shapes = _small_shapes(args.quick)
    shapes = [shapes[int(i)] for i in args.small_steps.split(",")] if args.small_steps else shapes
    rows = []
    for name, shape, pad in shapes:
        kp, vp, sets = make_steps(shape, pad=pad, nv=2 if args.quick else 8, hq=hq, hkv=hkv, seed=len(shape) + pad)
        q0, tb0, cu0, kv0 = sets[0]
        ref = ragged_paged_attention_ref(q0, kp, vp, tb0, cu0, kv0)
        n = int(cu0[-1])
        kv_bytes = int(np.asarray(kv0).sum()) * 2 * hkv * D * 2
        cases = [(label, ragged_call(args.interpret, **kw)) for label, kw in forms]
        if all(r[0] == 1 for r in shape):
            decode_forms = DECODE_FORMS[:1] if args.quick else DECODE_FORMS
            cases += [(label, _decode_call(args.interpret, kw)) for label, kw in decode_forms]
        base = None
        for label, fn in cases:
            try:
                t, outs, t_dev, _ = time_calls_and_device(fn, (kp, vp), sets, args.reps)
            except Exception as e:  # noqa: BLE001  (a form that does not compile: logged, the others go on)
                log(f"  {name} {label}: {str(e).splitlines()[0][:160]}")
                continue
            check(f"{name} {label} vs ref", outs[0][:n], ref[:n])
            tk = t_dev if t_dev == t_dev else t  # (the GPU's kernel time where there is one: the host clock is noisy)
            base = tk if base is None else base
            rows.append([name, label, us(t), "" if t_dev != t_dev else us(t_dev),
                         f"{kv_bytes / tk / 1e9:.0f}", fx(speed(base, tk))])
            PLOT.append(("small", f"{name}: {label} vs default", speed(base, tk)))
            log(f"  {name} {label}: {us(t)} us (GPU {us(t_dev) if t_dev == t_dev else 'n/a'})")
        del kp, vp, sets
    table(f"5. The small tile's keys per step ({hq}/{hkv} heads, d=128, page 16, bf16; GB/s = the rows' K+V bytes / "
          "GPU kernel time; speed = the default's GPU kernel time / the form's; the host clock's where there is none)",
          ["step", "form", "us", "GPU kernel us", "GB/s", "speed"], rows)


def _decode_call(interpret, kw):
    fn = functools.partial(paged_decode_attention, interpret=interpret, **kw)
    return lambda kp, vp, q, tb, cu, kv: fn(q, kp, vp, tb, kv)


# ---------------------------------------------------------------- tune

TUNE_SHAPES = {  # name -> step: (new tokens, kv length) per sequence
    "prefill": [(2048, 16384)],
    "decode": [(1, 4095)] * 256,
    "mixed": [(1, 4095)] * 63 + [(512, 4096)],
    "q64": [(64, 16384)],  # a question over an injected 16k segment (the engine's TTFT case)
    "q256": [(256, 16384)],
    # bench/serving/serve.py's closed loop at 256 clients: 28 questions of 64 tokens over a 4k segment beside 200
    # decode rows whose shared prefix the cascade reads (their ragged part is the private suffix)
    "serve": [(64, 4096)] * 28 + [(1, 100)] * 200,
}
# the serve shape also tries 256-row tiles (one 64-token question per program and kv head) and 128-key blocks
SERVE_KNOBS = [(w, st, bkv, rws) for rws in (128, 256) for bkv in (64, 128) for w, st in ((4, 2), (8, 2), (8, 3))]


@section
def tune(args):
    """Knob sweep on ``--tune-shapes`` (TUNE_SHAPES): best 4 (warps, stages, block_kv, tile rows) per shape."""
    hq, hkv = (4, 2) if args.quick else (HQ, HKV)
    g = hq // hkv
    if args.quick:
        shapes = [("mixed 3+16", [(1, 63)] * 3 + [(16, 64)])]
    else:
        shapes = [(n, TUNE_SHAPES[n]) for n in args.tune_shapes.split(",")]
    knobs = [(w, st, bkv, rws) for w in (4, 8) for st in (2, 3) for bkv in (32, 64)
             for rws in (64, 128)]
    if args.quick:
        knobs = knobs[:2]
    rows = []
    for name, step in shapes:
        kp, vp, sets = make_steps(step, nv=2, hq=hq, hkv=hkv, seed=len(step))
        results = []
        try:
            sec, _ = time_calls(ragged_call(args.interpret), (kp, vp), sets, max(3, args.reps // 2))
            rows.append([name, "default", "", "", "", us(sec)])
        except Exception as e:  # noqa: BLE001
            log(f"  {name} defaults: {str(e).splitlines()[0][:160]}")
        for w, st, bkv, rws in (SERVE_KNOBS if name == "serve" else knobs):
            fn = ragged_call(args.interpret, num_warps=w, num_stages=st, block_kv=bkv,
                             block_q=max(1, rws // g))
            try:
                sec, _ = time_calls(fn, (kp, vp), sets, max(3, args.reps // 2))
                results.append((sec, w, st, bkv, rws))
            except Exception as e:  # noqa: BLE001
                log(f"  {name} warps={w} stages={st} block_kv={bkv} rows={rws}: "
                    f"{str(e).splitlines()[0][:160]}")
        results.sort()
        for sec, w, st, bkv, rws in results[:4]:
            rows.append([name, rws, bkv, w, st, us(sec)])
        del kp, vp, sets
    table("Tune: ragged knob sweep (best 4 per shape; tile rows = block_q * Hq/Hkv; the small "
          "tile keeps 16 rows)", ["shape", "tile rows", "block_kv", "warps", "stages", "us"], rows)


# ---------------------------------------------------------------- report

def write_report(args, argv):
    dev = jax.devices()[0]
    head = [f"# Ragged paged attention benchmark ({'quick' if args.quick else 'full'})", "",
            f"- command: `python bench/kernels/ragged.py {' '.join(argv)}`",
            f"- device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
            f"interpret={args.interpret}",
            f"- date: {datetime.date.today().isoformat()}", f"- code: {code_version()}", "",
            "Speed ratios are the other kernel's time / the ragged kernel's time (> 1: ragged "
            "is faster).", ""]
    if FAILURES:
        head += ["**FAILURES:**", ""] + [f"- {f}" for f in FAILURES] + [""]
    write_md(args.out, "ragged.md", head + MD)
    plt = pyplot()
    pts = [p for p in PLOT if p[2] is not None]
    if plt is None or not pts:
        return
    colors = {"prefill": "tab:blue", "decode": "tab:orange", "mixed": "tab:green", "splits": "tab:purple",
              "small": "tab:red"}
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(pts) + 1.5))
    y = np.arange(len(pts))[::-1]
    ax.barh(y, [p[2] for p in pts], color=[colors[p[0]] for p in pts])
    ax.set_yticks(y)
    ax.set_yticklabels([f"{p[0]}: {p[1]}" for p in pts], fontsize=7)
    for yi, p in zip(y, pts):
        ax.text(p[2], yi, f" {p[2]:.2f}", va="center", fontsize=7)
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.axvline(0.9, color="red", lw=0.8, ls=":")
    ax.set_xlabel("speed ratio: other time / ragged time (> 1 = ragged faster; dotted: 0.9)")
    ax.set_title(f"Ragged paged attention ({dev.device_kind}, bf16, d=128, page 16)",
                 fontsize=9)
    save_plot(fig, args.out, "ragged.png")


def main():
    ap = parser(__doc__, "tiny shapes (works on CPU)")
    ap.add_argument("--tune", action="store_true", help="also sweep the knobs")
    ap.add_argument("--sections", default="01234", help="subset of 0,1,2,3,4,5 to run")
    ap.add_argument("--tune-shapes", default="prefill,decode,mixed",
                    help=f"--tune: the shapes swept, comma separated, of {','.join(TUNE_SHAPES)}")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--small-forms", default="", help="section 5: indices into SMALL_FORMS (default: all)")
    ap.add_argument("--small-steps", default="", help="section 5: indices into its steps (default: all)")
    args = ap.parse_args()
    args.interpret = jax.default_backend() != "gpu"
    args.reps = args.reps or (2 if args.quick else 10)
    plan = [("0", correctness), ("1", prefill), ("2", decode), ("3", mixed), ("4", splits), ("5", small_tile),
            (None if args.tune else "", tune)]
    return run_sections(args, plan, report, note=f"interpret={args.interpret}")


def report(args, t0):
    MD.append(f"total time: {time.time() - t0:.0f} s")
    write_report(args, sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
