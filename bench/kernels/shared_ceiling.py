"""How fast could the mixed steps' shared part be?  The engine's kernel against dense attention libraries.

Usage (from the repository root)::

    python bench/kernels/shared_ceiling.py                       # H100 / H200: ~2 minutes
    python bench/kernels/shared_ceiling.py --smoke --out /tmp/sc  # tiny shapes on the CPU: engine, jnp forms; Mosaic lowered

The cascade's shared part of a mixed step (``inferscale_jax/kv_cache.py``'s ``_mixed``): each group's
query tokens (its decode rows' one token each, its questions' 64) attend, without a mask, to the group's
shared segment of 4096 tokens, and return outputs and log-sum-exps for the merge with the private part.
At C = 256 it is ~4.4 ms of a ~19.7 ms step at ~215 TFLOP/s (bench/NOTES.md, runs AN and AO),
the Triton tile's ceiling. Whether a Hopper-specific kernel (wgmma fed by TMA, warp-specialised: the
FlashAttention-3 design) would be worth writing for it depends on what such kernels reach on this *small,
ragged* work, which this measures, one layer (Llama-3-8B heads: 32 q, 8 kv, head_dim 128) of the steps
``bench/kernels/mixed_shared.py`` defines, N = 8 segments, token ``t``'s group ``row % 8``:

* ``engine``: ``grouped_shared_prefix_attention`` over the paged pool (bf16; what the engine runs).
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on a dense copy of each group's
  segment (``[G, 4096, 8, 128]``, made outside the timed call) with the group's tokens padded to the
  largest group and ``query_seq_lengths`` (bf16, GQA native).  Its log-sum-exps would come back in bf16
  only (``return_residual``), too coarse for the merge: an upper bound of what it would give the engine.
* ``mosaic``: jax's FlashAttention-3 kernel in Pallas Mosaic GPU
  (``jax.experimental.pallas.ops.gpu.attention_mgpu``), same dense segments, each group's tokens x 4 query
  heads folded into rows (``[G, rows, 8, 128]``: the work is unmasked, so a kv head's 4 query heads are
  just more rows), padded to ``2 * block_q``; **float16** (the library's shared-memory buffers are float16
  as shipped: same speed as bf16), q pre-scaled (the kernel applies no softmax scale). Its tunings are
  swept; each is checked.
* ``xla``: the same dense attention as plain jnp (einsum, softmax), for scale.

TFLOP/s count the real work only (4 x real query rows x 4096 x 128); ``padded`` says what the dense
forms computed. Every output is checked against ``engine``'s (bf16 / f16 tolerance); the dense forms are
timed on their own layout (the gather back to the engine's token order is made for the check only). Timing as
``bench/kernels/kernels.py`` (R input sets in one executable, median). Writes ``shared_ceiling.md`` and
``shared_ceiling.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib"), os.path.join(ROOT, "bench", "kernels")]
from cascade_groups import random_pool  # noqa: E402
from common import matmul_ceiling  # noqa: E402
from kernels import check, time_calls  # noqa: E402
from report import FAILURES, finish, log, save_plot, step_axes, table  # noqa: E402
from pallas_kernels.cascade_attention import grouped_shared_prefix_attention  # noqa: E402

FULL = dict(hq=32, hkv=8, d=128, s=16, seg=4096, groups=8, question=64, sets=4, reps=10,
            steps={"C = 64 (61 rows + 1 question)": (61, 1), "spread, C = 256 (250 rows + 3 questions)": (250, 3),
                   "cohort (200 rows + 28 questions)": (200, 28)})
SMOKE = dict(hq=8, hkv=2, d=64, s=8, seg=64, groups=3, question=8, sets=1, reps=1,
             steps={"smoke": (10, 2)})
# (block_q, block_kv, concurrent steps): the pipeline's K/V buffers must fit the SM's ~227 KiB of shared memory
MOSAIC_TUNINGS = [(64, 64, 2), (64, 64, 4), (64, 128, 2), (64, 128, 3)]
RESULTS: list = []  # (step, form, seconds, real flops, padded flops)


def step_case(cfg, decode, questions):
    """One step's tokens, their groups, the paged pool and the same segments dense.  Returns (paged inputs,
    dense inputs, the engine's token order -> (group, slot) map, real tokens)."""
    g, seg, s, hq, hkv, d = (cfg[k] for k in ("groups", "seg", "s", "hq", "hkv", "d"))
    lens = [1] * decode + [cfg["question"]] * questions
    row_of_token = np.repeat(np.arange(len(lens)), lens)
    group = (row_of_token % g).astype(np.int32)  # [T] each token's group
    t = len(group)
    slot = np.zeros(t, np.int32)  # each token's place among its group's tokens
    count = np.zeros(g, np.int32)
    for i, gi in enumerate(group):
        slot[i], count[gi] = count[gi], count[gi] + 1
    seg_pages = seg // s
    sets = []
    for i in range(cfg["sets"]):
        kp, vp = random_pool(jax.random.PRNGKey(100 + i), hkv, 1 + g * seg_pages, s, d)
        ids = 1 + np.random.default_rng(i).permutation(g * seg_pages).astype(np.int32)
        pages = ids.reshape(g, seg_pages)
        q = jax.random.normal(jax.random.PRNGKey(7 + i), (t, hq, d), jnp.bfloat16)
        # dense segments [G, seg, Hkv, D]: the pages in order
        k_dense = jnp.transpose(kp[:, jnp.asarray(pages)].reshape(hkv, g, seg, d), (1, 2, 0, 3))
        v_dense = jnp.transpose(vp[:, jnp.asarray(pages)].reshape(hkv, g, seg, d), (1, 2, 0, 3))
        sets.append(dict(kp=kp, vp=vp, q=q, pages=jnp.asarray(pages), k=k_dense, v=v_dense))
    return sets, group, slot, count, t


def padded_q(q, group, slot, count, width):
    """[T, Hq, D] tokens -> [G, width, Hq, D] per group (zeros past its tokens)."""
    out = jnp.zeros((len(count), width) + q.shape[1:], q.dtype)
    return out.at[jnp.asarray(group), jnp.asarray(slot)].set(q)


def folded_q(q, group, slot, count, hkv, multiple):
    """[T, Hq, D] -> [G, rows, Hkv, D]: a kv head's query heads folded into rows (token-major), padded to
    ``multiple`` rows; returns (folded, rows per token = Hq // Hkv)."""
    gq = q.shape[1] // hkv
    width = int(-(-int(count.max()) * gq // multiple) * multiple)
    per = q.reshape(q.shape[0], hkv, gq, q.shape[2]).transpose(0, 2, 1, 3)  # [T, gq, Hkv, D]
    out = jnp.zeros((len(count), width, hkv, q.shape[2]), q.dtype)
    rows = (jnp.asarray(slot)[:, None] * gq + jnp.arange(gq)[None, :])  # [T, gq]
    return out.at[jnp.asarray(group)[:, None], rows].set(per), gq


def unfold(out, group, slot, hkv, gq):
    """The inverse of ``folded_q`` for the kernel's output: [G, rows, Hkv, D] -> [T, Hq, D]."""
    rows = jnp.asarray(slot)[:, None] * gq + jnp.arange(gq)[None, :]
    per = out[jnp.asarray(group)[:, None], rows]  # [T, gq, Hkv, D]
    return per.transpose(0, 2, 1, 3).reshape(per.shape[0], hkv * gq, per.shape[-1])


def run_step(args, cfg, name, decode, questions):
    sets, group, slot, count, t = step_case(cfg, decode, questions)
    hq, hkv, d, seg, g = (cfg[k] for k in ("hq", "hkv", "d", "seg", "groups"))
    real_flops = 4 * t * hq * seg * d
    log(f"{name}: {t} tokens in {g} groups (largest {int(count.max())}); {real_flops / 1e9:.1f} GFLOP real")
    scale = 1.0 / math.sqrt(d)
    row_group = jnp.asarray(group)
    glens = jnp.full((g,), seg, jnp.int32)

    def engine(kp, vp, q, pages):
        return grouped_shared_prefix_attention(q, kp, vp, pages, glens, row_group, real_groups=g, real_rows=t)[0]

    t_eng, outs = time_calls(engine, (), [(x["kp"], x["vp"], x["q"], x["pages"]) for x in sets], cfg["reps"])
    base = np.asarray(outs[0], np.float32)
    RESULTS.append((name, "engine", t_eng, real_flops, real_flops))
    log(f"  engine: {t_eng * 1e6:.1f} us, {real_flops / t_eng / 1e12:.0f} TFLOP/s")

    def timed(form, fn, inputs, padded_flops, tol=2e-2, back=lambda o: o[jnp.asarray(group), jnp.asarray(slot)]):
        """Time ``fn`` on its own layout; ``back`` maps its first output to the engine's token order."""
        try:
            sec, outs = time_calls(fn, (), inputs, cfg["reps"])
        except Exception as err:  # noqa: BLE001 - a form this device or jax cannot run is reported, not fatal
            log(f"  {form}: failed ({type(err).__name__}: {str(err)[:300]})")
            RESULTS.append((name, form, math.nan, real_flops, padded_flops))
            return
        check(f"{name} {form} vs engine", np.asarray(back(outs[0]), np.float32), base, tol)
        RESULTS.append((name, form, sec, real_flops, padded_flops))
        log(f"  {form}: {sec * 1e6:.1f} us, {real_flops / sec / 1e12:.0f} TFLOP/s real "
            f"({padded_flops / sec / 1e12:.0f} padded), engine / it {t_eng / sec:.2f}x")

    width = int(count.max())
    dense_in = [(padded_q(x["q"], group, slot, count, width), x["k"], x["v"]) for x in sets]
    qlen = jnp.asarray(count)
    pad_flops = 4 * g * width * hq * seg * d

    def xla(qg, k, v):
        kk, vv = jnp.repeat(k, hq // hkv, axis=2), jnp.repeat(v, hq // hkv, axis=2)
        sc = jnp.einsum("gthd,gshd->ghts", qg, kk, preferred_element_type=jnp.float32) * scale
        return jnp.einsum("ghts,gshd->gthd", jax.nn.softmax(sc, axis=-1).astype(vv.dtype), vv)

    timed("xla (dense jnp)", xla, dense_in, pad_flops)
    if args.smoke:  # (cudnn and Mosaic GPU need a GPU): the folding the mosaic form uses, checked in jnp, and
        # the mosaic call lowered for CUDA on this host
        folded = [folded_q(x["q"], group, slot, count, hkv, 128) for x in sets]

        def folded_jnp(qf, k, v, gq=folded[0][1]):
            sc = jnp.einsum("grhd,gshd->ghrs", qf, k, preferred_element_type=jnp.float32) * scale
            return jnp.einsum("ghrs,gshd->grhd", jax.nn.softmax(sc, axis=-1).astype(v.dtype), v)

        timed("folded rows (jnp)", folded_jnp, [(f, x["k"], x["v"]) for (f, _), x in zip(folded, sets)], pad_flops,
              back=lambda o, gq=folded[0][1]: unfold(o, group, slot, hkv, gq))
        try:
            from jax.experimental.pallas.ops.gpu import attention_mgpu
            if attention_mgpu.cuda_versions is None:  # (no CUDA libraries here: a stand-in for the runtime version)
                attention_mgpu.cuda_versions = type("V", (), {"cuda_runtime_get_version": staticmethod(lambda: 13000)})
            f16 = [(f.astype(jnp.float16), x["k"].astype(jnp.float16), x["v"].astype(jnp.float16))
                   for (f, _), x in zip(folded, sets)][0]
            cfg_ = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
            jax.jit(lambda *a: attention_mgpu.attention(*a, cfg_)).trace(*f16).lower(lowering_platforms=("cuda",))
            log("  mosaic: lowers for CUDA")
        except Exception as err:  # noqa: BLE001 - reported: the GPU run would fail the same way
            log(f"  mosaic: does not lower for CUDA here ({type(err).__name__}: {str(err)[:300]})")
            FAILURES.append(f"mosaic lowering: {type(err).__name__}: {str(err)[:200]}")
        return

    def cudnn(qg, k, v):
        return jax.nn.dot_product_attention(qg, k, v, scale=scale, query_seq_lengths=qlen, implementation="cudnn")

    timed("cudnn", cudnn, dense_in, pad_flops)
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except Exception as err:  # noqa: BLE001 - not in this jax
        log(f"  mosaic: not available ({type(err).__name__}: {err})")
        return
    for bq, bkv, steps in MOSAIC_TUNINGS:
        multiple = 2 * bq  # (two compute warpgroups of block_q rows each)
        folded = [folded_q((x["q"].astype(jnp.float32) * scale).astype(jnp.float16), group, slot, count, hkv, multiple)
                  for x in sets]
        rows = folded[0][0].shape[1]
        gq = folded[0][1]
        inputs = [(f, x["k"].astype(jnp.float16), x["v"].astype(jnp.float16)) for (f, _), x in zip(folded, sets)]

        def mosaic(qf, k, v, bq=bq, bkv=bkv, steps=steps):
            cfg_ = attention_mgpu.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps)
            return attention_mgpu.attention(qf, k, v, cfg_)

        timed(f"mosaic f16 bq{bq} bkv{bkv} c{steps}", mosaic, inputs, 4 * g * rows * hkv * seg * d, tol=3e-2,
              back=lambda o, gq=gq: unfold(o, group, slot, hkv, gq))


def plot(out_dir):
    fig, panels = step_axes(RESULTS, 5.5, 4)
    if fig is None:
        return
    for ax, step in panels:
        rows = [r for r in RESULTS if r[0] == step and not math.isnan(r[2])]
        ax.barh([r[1] for r in rows], [r[3] / r[2] / 1e12 for r in rows])
        ax.set_title(step, fontsize=9)
        ax.set_xlabel("TFLOP/s (real work)")
    fig.tight_layout()
    save_plot(fig, out_dir, "shared_ceiling.png")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU, interpret mode): the harness only")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    cfg = SMOKE if args.smoke else FULL
    t0 = time.time()
    log(f"devices: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    ceiling = None if args.smoke else matmul_ceiling()
    if ceiling:
        log(f"matmul ceiling (bf16 8192^3): {ceiling / 1e12:.0f} TFLOP/s")
    for name, (decode, questions) in cfg["steps"].items():
        run_step(args, cfg, name, decode, questions)
    rows = []
    for step, form, sec, real, padded in RESULTS:
        eng = next(r[2] for r in RESULTS if r[0] == step and r[1] == "engine")
        rows.append([step, form, "failed" if math.isnan(sec) else f"{sec * 1e6:.1f}",
                     "" if math.isnan(sec) else f"{real / sec / 1e12:.0f}",
                     "" if math.isnan(sec) else f"{padded / sec / 1e12:.0f}",
                     "" if math.isnan(sec) or not ceiling else f"{real / sec / ceiling:.0%}",
                     "" if math.isnan(sec) else f"{eng / sec:.2f}x"])
    table("The shared part of one layer (us; TFLOP/s of the real work, and of what the form computed; "
          "engine / form: > 1 is faster than the engine)",
          ["step", "form", "us", "TFLOP/s real", "TFLOP/s computed", "of the matmul ceiling", "engine / form"], rows)
    os.makedirs(args.out, exist_ok=True)
    plot(args.out)
    finish(args.out, "shared_ceiling.md", "The mixed steps' shared part: the engine's kernel against dense attention "
           "libraries", t0, ROOT, [f"- matmul ceiling {ceiling / 1e12:.0f} TFLOP/s (this run)"] if ceiling else [])


if __name__ == "__main__":
    main()
