"""Shared conventions of the Pallas kernels: page layout, backend selection, input checks.

Page layout (one layer): ``k_pages``/``v_pages`` are ``[Hkv, P, S, D]``: ``P`` pages of ``S``
token slots each, per KV head, so one page of one head is a contiguous ``[S, D]`` tile (the
unit a GPU program loads).  Page 0 is the engine's null page: padded page-table entries point
at it and it is never read unmasked.  A token's *slot* is ``page * S + offset``.

``page_table [B, max_pages] int32`` lists each sequence's pages in position order;
``lengths``/``kv_lens [B] int32`` count the valid tokens of each sequence (the rest of the
table is padding).

Backends: every kernel is written in the Triton style of Pallas and always passes
``jax.experimental.pallas.triton.CompilerParams`` explicitly (without them jax 0.10 routes to
Mosaic GPU and 0.11 to Triton).  ``interpret`` defaults to ``True`` off the GPU, so the same
kernels run (slowly) on the CPU in tests.  The TPU (Mosaic) kernels of :mod:`pallas_kernels.tpu`
read the same layout (its ``common`` holds their tiling rules).

This package imports nothing from the engine.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt


def default_interpret() -> bool:
    """Interpret kernels unless running on a GPU."""
    return jax.default_backend() != "gpu"


def slot_prefetch() -> bool:
    """Whether the paged kernels' loops carry the next tile's page slots from one iteration to the
    next (True, the default) or compute each tile's slots in its own iteration (False), from the
    loop index and a page-table read of that iteration (an indirect load, which Triton's software
    pipeliner can issue ahead: ``stages_for``).  ``INFERSCALE_SLOT_PREFETCH=0`` picks False (an A/B switch for the
    benchmarks, bench/NOTES.md); the kernels' ``prefetch`` argument overrides it."""
    return os.environ.get("INFERSCALE_SLOT_PREFETCH", "1") != "0"


def stages_for(default: int, prefetch: bool) -> int:
    """A paged kernel's default ``num_stages``: ``default`` when its loop carries the slots, else at
    least 3.  Without the carry the K/V loads are *indirect* (their addresses come from a page-table
    load in the same iteration), and Triton's pipeliner issues an indirect load ahead only with 3
    stages or more (with 2 it leaves it unpipelined: triton-lang/triton#4721)."""
    return default if prefetch else max(default, 3)


MIXED_SHARED_KNOBS = dict(br="block_rows", bk="block_kv", w="num_warps", st="num_stages", sp="num_splits",
                          cb="chunk_block_rows", cw="chunk_num_warps", cs="chunk_num_splits")


MIXED_RAGGED_KNOBS = dict(bq="block_q", bk="block_kv", w="num_warps", st="num_stages", sp="kv_splits",
                          sl="split_longest", lk="long_keys", sk="small_block_kv", tl="separate_tiles")


def mixed_shared_knobs() -> dict:
    """``INFERSCALE_MIXED_SHARED`` (e.g. ``br=128,w=8,sp=1``): knobs of the cascade shared part in
    the engine's mixed steps that override its defaults (``inferscale_jax/kv_cache.py``), by
    ``MIXED_SHARED_KNOBS``' short names; unset: none.  ``cb=N`` (with ``cw=W`` its warps, ``cs=S`` its
    splits) runs the prefill chunks' tokens in a launch of their own with ``N``-row blocks, the one-token
    rows' in the other with ``br``'s; ``cw`` / ``cs`` without ``cb`` are refused.  An A/B switch for the
    benchmarks (bench/NOTES.md)."""
    knobs = _knobs("INFERSCALE_MIXED_SHARED", MIXED_SHARED_KNOBS, tiles=dict(br=MIN_DOT_DIM, bk=MIN_DOT_DIM,
                                                                             cb=MIN_DOT_DIM))
    alone = sorted(k for k in ("cw", "cs") if MIXED_SHARED_KNOBS[k] in knobs and "chunk_block_rows" not in knobs)
    if alone:
        raise ValueError(f"INFERSCALE_MIXED_SHARED={os.environ.get('INFERSCALE_MIXED_SHARED')!r}: {alone} set the "
                         f"chunks' own launch, which only cb=N makes; add cb=N or drop them")
    return knobs


def mixed_ragged_knobs() -> dict:
    """``INFERSCALE_MIXED_RAGGED`` (e.g. ``sp=1`` or ``sl=0``): knobs of the ragged kernel in the
    engine's mixed steps (``pallas_kernels/ragged_attention.py``), by ``MIXED_RAGGED_KNOBS``' short
    names (``sl=0``: every block split-KV, not only the longest (``split_longest``, the kernel's
    default), ``lk``: ``split_longest``'s ``long_keys``, ``sk``: the small (decode-row) tile's keys per step,
    ``tl=1``: the two tiles in launches of their own, ``separate_tiles``);
    unset: none.  An A/B switch for the
    benchmarks (bench/NOTES.md)."""
    knobs = _knobs("INFERSCALE_MIXED_RAGGED", MIXED_RAGGED_KNOBS, tiles=dict(bq=1, bk=MIN_DOT_DIM, sk=MIN_DOT_DIM),
                   flags=("sl", "tl"))
    return {k: bool(v) if k in ("split_longest", "separate_tiles") else v for k, v in knobs.items()}


DECODE_SHARED_KNOBS = dict(br="block_rows", bk="block_kv", w="num_warps", st="num_stages", sp="num_splits")


def decode_shared_knobs() -> dict:
    """``INFERSCALE_DECODE_SHARED`` (e.g. ``w=8`` or ``br=32,sp=2``): knobs of the cascade shared part in the
    engine's decode steps (``inferscale_jax/kv_cache.py``, ``_decode_shared_knobs``) that override its defaults,
    by ``DECODE_SHARED_KNOBS``' short names (as ``INFERSCALE_MIXED_SHARED``'s for the mixed steps); unset: none.
    An A/B switch for the benchmarks (bench/NOTES.md, session 47)."""
    return _knobs("INFERSCALE_DECODE_SHARED", DECODE_SHARED_KNOBS, tiles=dict(br=MIN_DOT_DIM, bk=MIN_DOT_DIM))


DECODE_KNOBS = dict(bk="block_tokens", w="num_warps", st="num_stages")


def decode_knobs() -> dict:
    """``INFERSCALE_DECODE`` (e.g. ``st=1`` or ``bk=64,w=2``): knobs of the paged decode kernel
    (``pallas_kernels/decode_attention.py``: the decode steps' private part, with or without a cascade) that
    override its defaults where its caller leaves them unset, by ``DECODE_KNOBS``' short names (``bk``: KV tokens
    per block, a power of two >= 16 and >= the page size); unset: none.  An A/B switch for the benchmarks
    (bench/NOTES.md, session 45: the kernel's occupancy)."""
    return _knobs("INFERSCALE_DECODE", DECODE_KNOBS, tiles=dict(bk=MIN_DOT_DIM))


def _knobs(var: str, table: dict, tiles, flags=()) -> dict:
    """Parse ``var``'s ``NAME=N,...`` into ``{table[NAME]: N}`` (``flags``: names that take 0 or 1); a
    bad item is a ``ValueError`` naming it."""
    spec = os.environ.get(var, "").strip()
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, value = item.partition("=")
        number = int(value) if value.isascii() and value.isdigit() else -1
        tile = name in tiles  # (tile sizes: powers of two, at least the dot's minimum)
        bad = number not in (0, 1) if name in flags else number < 1
        if name not in table or bad or tile and (number < tiles[name] or number & (number - 1)):
            sizes = ", ".join(f"{t}: a power of two >= {low}" for t, low in tiles.items())
            flagged = "".join(f"; {f}: 0 or 1" for f in flags)
            raise ValueError(f"{var}={spec!r}: {item!r} is invalid: each item must be NAME=N with "
                             f"N >= 1 ({sizes}{flagged}) and NAME one of "
                             f"{sorted(table)} ({table}); unset it for the defaults")
        out[table[name]] = number
    return out


def init_inputs(init, rows: int, num_kv_heads: int, head_dim: int, rows_name: str):
    """Check a kernel's ``init`` partials (``(row [rows], o [Hkv, NI, R, D], m [Hkv, NI, R], l [Hkv, NI, R])``:
    ``o`` fp32, or a 16-bit float when normalised; the decode and ragged kernels' ``init``) and flatten them for
    the launch: (NI, (row int32, o [Hkv, NI * R, D], m [Hkv, NI * R] fp32, l likewise)); split ``u``'s rows at
    ``u * R`` (free reshapes).  None: (0, ())."""
    if init is None:
        return 0, ()
    want = (f"(row [{rows_name}={rows}], o [Hkv={num_kv_heads}, NI, R, D={head_dim}], m [Hkv, NI, R], "
            "l [Hkv, NI, R]) with NI, R >= 1")
    if not isinstance(init, (tuple, list)) or len(init) != 4:
        _fail("init", f"{type(init).__name__} of {len(init) if isinstance(init, (tuple, list)) else 1}",
              f"a tuple of 4 arrays {want}")
    row, o, m, l = init
    if (row.shape != (rows,) or o.ndim != 4 or o.shape[0] != num_kv_heads or o.shape[3] != head_dim
            or 0 in o.shape or m.shape != o.shape[:3] or l.shape != o.shape[:3]):
        _fail("init", [tuple(x.shape) for x in init], want)
    if not jnp.issubdtype(o.dtype, jnp.floating) or jnp.dtype(o.dtype).itemsize < 2:
        _fail("init's o dtype", o.dtype, "float32, or a 16-bit float with o normalised")
    splits, flat = o.shape[1], o.shape[1] * o.shape[2]
    return splits, (row.astype(jnp.int32), o.reshape(num_kv_heads, flat, head_dim),
                    m.astype(jnp.float32).reshape(num_kv_heads, flat), l.astype(jnp.float32).reshape(num_kv_heads, flat))


MIXED_DECODE_CHOICES = ("ragged", "cascade")


def env_choice(name: str, choices) -> str:
    """Environment variable ``name``'s value, one of ``choices`` (the first when unset or empty);
    any other value is a ``ValueError`` that names the variable, the value and the choices."""
    choices = tuple(choices)
    value = os.environ.get(name, "").strip() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r} is invalid: use one of {list(choices)} (unset: {choices[0]})")
    return value


def mixed_decode() -> str:
    """``INFERSCALE_MIXED_DECODE``: how a mixed step with cascade groups attends its one-token rows
    (``inferscale_jax/kv_cache.py``, ``_mixed_split``).  ``ragged`` (the default): every row through
    the ragged kernel, the group rows' shared prefixes through the shared part of the chunks' tokens;
    ``cascade``: the one-token rows through the decode step's cascade kernel, the rest as before
    (measured slower: +8% a mixed step at C = 64, +16% at 256 on an H100, bench/NOTES.md run AR).
    An A/B switch for the benchmarks."""
    return env_choice("INFERSCALE_MIXED_DECODE", MIXED_DECODE_CHOICES)


MIXED_MERGE_CHOICES = ("kernel", "jnp")


def mixed_merge() -> str:
    """``INFERSCALE_MIXED_MERGE``: where a mixed step's shared part (cascade groups) meets its ragged part
    (``inferscale_jax/kv_cache.py``, ``_mixed_shared``).  ``kernel`` (the default): the ragged kernel starts
    each group token's online softmax from the shared part's split partials, so its output is final;
    ``jnp``: the shared part's splits merged and normalised in jnp, the ragged kernel's lse returned, the
    two merged per token after it (the form before session 39).  An A/B switch for the benchmarks."""
    return env_choice("INFERSCALE_MIXED_MERGE", MIXED_MERGE_CHOICES)


SHARED_PARTIALS_CHOICES = ("q_dtype", "fp32")


def shared_partials() -> str:
    """``INFERSCALE_SHARED_PARTIALS``: how the cascade shared part stores its split partials for the kernel that
    continues from them (``pallas_kernels/cascade_attention.py``).  ``q_dtype`` (the default since run AY): with
    16-bit queries, ``o`` normalised in the queries' dtype, ``m`` the base-2 log-sum-exp and ``l`` 1 (0 for no
    key), so a reader's merge is unchanged and reads half the bytes (fp32 queries keep fp32); ``fp32``: unnormalised
    ``o``, base-2 ``m``, ``l``, all fp32 (the form before).  Measured on an H100: the spread step's attention
    -3%, the bare loop at C = 256 +1.6% (bench/NOTES.md, run AY).  An A/B switch for the benchmarks."""
    return env_choice("INFERSCALE_SHARED_PARTIALS", SHARED_PARTIALS_CHOICES)


SHARED_Q_CHOICES = ("gather", "kernel")


def shared_q_rows() -> str:
    """``INFERSCALE_SHARED_Q``: how the cascade shared part's programs get their packed query rows
    (``pallas_kernels/cascade_attention.py``).  ``gather`` (the default): a jnp gather writes a packed copy of
    the queries (``[Hkv, row blocks x rows, D]``) that each program reads as one tile; ``kernel``: each program
    gathers its rows from the queries themselves through the packed rows' sources, so the step has no gather
    kernel and no packed copy.  An A/B switch for the benchmarks (bench/NOTES.md, session 44)."""
    return env_choice("INFERSCALE_SHARED_Q", SHARED_Q_CHOICES)


SAMPLER_CHOICES = ("gumbel", "cdf")


def sampler_draw() -> str:
    """``INFERSCALE_SAMPLER``: how the engine's sampler draws a sampled row's token (``inferscale_jax/sampling.py``,
    ``sample_tokens``'s ``draw``).  ``gumbel`` (the default): ``jax.random.categorical``, Gumbel noise over the
    whole vocabulary (threefry bits for every row and vocabulary entry, greedy rows included); ``cdf``: the
    inverse of the kept distribution's CDF with one uniform a row.  The same distribution; a seed draws other
    tokens under each.  An A/B switch for the benchmarks (bench/NOTES.md, session 44)."""
    return env_choice("INFERSCALE_SAMPLER", SAMPLER_CHOICES)


NORM_CHOICES = ("jnp", "pallas")


def norm() -> str:
    """``INFERSCALE_NORM``: how the model's residual adds and RMSNorms run on a cache with the Pallas kernels
    (``inferscale_jax/kv_cache.py``, ``PagedKVCache.add_rms_norm``).  ``jnp`` (the default): the model's own
    form, fused by XLA; ``pallas``: each add and the norm after it in one kernel
    (``pallas_kernels/norm.py``).  An A/B switch for the benchmarks (bench/NOTES.md, the glue)."""
    return env_choice("INFERSCALE_NORM", NORM_CHOICES)


ROPE_CHOICES = ("pallas", "jnp")


def rope() -> str:
    """``INFERSCALE_ROPE``: how the model splits its fused qkv projection into heads and rotates q and k on a cache
    with the Pallas kernels (``inferscale_jax/kv_cache.py``, ``PagedKVCache.qkv_rope``).  ``pallas`` (the
    default): one kernel (``pallas_kernels/rope.py``; measured 2x faster than XLA's fusion by itself, run AY);
    ``jnp``: the model's own form, fused by XLA.  An A/B switch for the benchmarks."""
    return env_choice("INFERSCALE_ROPE", ROPE_CHOICES)


MATMUL_CHOICES = ("pallas", "xla")


def matmul() -> str:
    """``INFERSCALE_MATMUL``: how the model's projections run at decode-sized row counts on a cache with the
    Pallas kernels (``inferscale_jax/kv_cache.py``, ``PagedKVCache.linear``).  ``pallas`` (the default since run
    BA): the skinny-matmul kernel (``pallas_kernels/gemm.py``) at the row counts and shapes where it won
    (``kv_cache.MATMUL_MIN_ROWS``-``MATMUL_MAX_ROWS`` rows, at most ``MATMUL_MAX_N`` columns; measured on an H100:
    the 128-token step -0.32 ms, the bare loop at C = 64 +1.6%); ``xla``: XLA's dot everywhere.  An A/B switch for
    the benchmarks (bench/NOTES.md, runs AZ and BA)."""
    return env_choice("INFERSCALE_MATMUL", MATMUL_CHOICES)


def switches() -> dict:
    """The environment's switches that change the kernels' programs (for caches keyed without
    tracing, such as the engine's executable store: a switch must name another entry)."""
    return {"slot_prefetch": slot_prefetch(), "mixed_shared": sorted(mixed_shared_knobs().items()),
            "mixed_decode": mixed_decode(), "decode": sorted(decode_knobs().items()),
            "decode_shared": sorted(decode_shared_knobs().items()),
            "mixed_ragged": sorted(mixed_ragged_knobs().items()),
            "mixed_merge": mixed_merge(), "shared_partials": shared_partials(), "shared_q": shared_q_rows(),
            "sampler": sampler_draw(), "norm": norm(), "rope": rope(), "matmul": matmul()}


def switches_key() -> tuple:
    """``switches()`` as a hashable tuple (a static field that keys jit caches)."""
    return tuple(sorted((k, repr(v)) for k, v in switches().items()))


def compiler_params(num_warps: int = 4, num_stages: int = 2) -> plt.CompilerParams:
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _fail(name: str, value, expected: str) -> None:
    raise ValueError(f"{name}: got {value}, expected {expected}")


def check_pages(k_pages: jax.Array, v_pages: jax.Array) -> tuple[int, int, int, int]:
    """Validate a layer's K/V page arrays ``[Hkv, P, S, D]``; return (Hkv, P, S, D)."""
    if k_pages.ndim != 4:
        _fail("k_pages.shape", k_pages.shape, "[Hkv, P, S, D] (4 dims)")
    if v_pages.shape != k_pages.shape:
        _fail("v_pages.shape", v_pages.shape, f"the shape of k_pages {k_pages.shape}")
    if v_pages.dtype != k_pages.dtype:
        _fail("v_pages.dtype", v_pages.dtype, f"the dtype of k_pages ({k_pages.dtype})")
    return tuple(int(x) for x in k_pages.shape)  # type: ignore[return-value]


def check_int_vector(name: str, x: jax.Array, n: int) -> None:
    if x.shape != (n,):
        _fail(f"{name}.shape", x.shape, f"({n},)")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        _fail(f"{name}.dtype", x.dtype, "an integer dtype (int32)")


def check_page_table(page_table: jax.Array, batch: int) -> int:
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        _fail("page_table.shape", page_table.shape, f"[{batch}, max_pages]")
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        _fail("page_table.dtype", page_table.dtype, "int32")
    return int(page_table.shape[1])


def check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    if num_q_heads % num_kv_heads:
        _fail("num_q_heads", num_q_heads, f"a multiple of num_kv_heads={num_kv_heads}")
    return num_q_heads // num_kv_heads


# ---- Added for the decode / splice / kv-write kernels (signatures above are unchanged). ----

# Triton tiles need power-of-two shapes and matmul dims of at least 16.
MIN_DOT_DIM = 16


def check_power_of_two(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum or value & (value - 1):
        _fail(name, value, f"a power of two >= {minimum} (Triton tiles are power-of-two shaped)")


def check_dtype(name: str, x: jax.Array, expected) -> None:
    if x.dtype != jnp.dtype(expected):
        _fail(f"{name}.dtype", x.dtype, f"{jnp.dtype(expected)} (cast it first)")


def is_concrete(*xs) -> bool:
    """True when every argument holds a value (not a tracer), so host-side checks may read it."""
    try:
        tracer = jax.core.Tracer
    except AttributeError:  # should a future jax drop the public alias
        from jax._src.core import Tracer as tracer
    return not any(isinstance(x, tracer) for x in xs)


def num_sms(default: int = 132) -> int:
    """Streaming multiprocessors of the default device (132 on an H100/H200 SXM)."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or default) if dev.platform == "gpu" else default


def merge_splits(o_part: jax.Array, lse: jax.Array, dtype, return_lse: bool = False):
    """Merge split-KV partial outputs: ``o_part [splits, ..., D]`` (normalised per split) and
    ``lse [splits, ...]`` (log2-sum-exp per row, ``-inf`` for an empty split) ->
    ``sum_s o_s 2^lse_s / sum_s 2^lse_s`` in ``dtype``; rows empty in every split give 0.
    ``return_lse``: also the merged log2-sum-exp ``[...]`` (``-inf`` for rows empty in every split)."""
    lse_max = lse.max(axis=0)
    shift = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    w = jnp.exp2(lse - shift)  # empty split: 0
    denom = w.sum(axis=0)
    out = ((w[..., None] * o_part).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]).astype(dtype)
    if not return_lse:
        return out
    return out, jnp.where(denom > 0, shift + jnp.log2(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)


def check_scales(k_pages: jax.Array, k_scale, v_scale) -> bool:
    """Compressed pages (``pallas_kernels/quant.py``): int8 / float8 ``k_pages`` need float32 scales
    ``[Hkv, P, S]`` for K and V; other pages take none.  Returns whether the pages are quantized."""
    quantized = k_pages.dtype in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        _fail("k_scale / v_scale", "given" if k_scale is not None else None,
              "both, exactly when the pages are int8 / float8_e4m3fn (one float32 scale per token and head)")
    if quantized:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc.shape != k_pages.shape[:-1]:
                _fail(f"{name}.shape", sc.shape, f"{k_pages.shape[:-1]} = [Hkv, P, S] of the pages")
            check_dtype(name, sc, jnp.float32)
    return quantized


def query_dtype_ok(q: jax.Array, k_pages: jax.Array, quantized: bool) -> None:
    """q has the pages' dtype, or (compressed pages) any float dtype the pages dequantize to."""
    if quantized:
        if not jnp.issubdtype(q.dtype, jnp.floating) or q.dtype == jnp.dtype(jnp.float8_e4m3fn):
            _fail("q.dtype", q.dtype, "bfloat16 / float16 / float32 (compressed pages dequantize to q's dtype)")
    else:
        check_dtype("q", q, k_pages.dtype)
