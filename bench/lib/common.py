"""What the benchmarks share: the model shapes they run, the model config built from a shape,
and the read-only bandwidth ceiling.

``LLAMA3_8B`` is the shape every GPU headline uses (random bf16 weights); each benchmark's
``--quick`` mode uses a tiny shape of the same architecture to check its harness on the CPU.
A shape is a plain dict (``vocab``, ``hidden``, ``inter``, ``layers``, ``heads``, ``kv``,
``head_dim``, ``theta``, ``max_pos``, ``eps``); ``model_config`` turns it into the engine's
``ModelConfig``; ``shape(quick, **over)`` picks one and overrides fields (a benchmark that needs a
larger tiny vocabulary, say).

``read_bandwidth``: bytes/s of a device reduction over a large array - read-only traffic, the
ceiling for kernels that only read (decode attention, a decode step's weight reads).  A copy
(read + write) is a different ceiling; reports name which one they use.  ``matmul_ceiling``: the
bf16 FLOP/s of a large dense matmul on this device, the compute ceiling beside the datasheet's
``H200_BF16_PEAK``.

Rooflines: ``forward_flops(sh, T, C)`` counts the FLOPs of T new tokens over C cached ones (the
matmuls of every layer and the LM head at 2 FLOPs per multiply-add, causal attention counting only
unmasked work); ``step_read_bytes(sh)`` the bytes a forward step must read (every weight but the
embedding table, of which a step gathers only its tokens' rows); a step's floor is
``max(bytes / bandwidth, flops / compute)`` (``floor_s``), never their sum.

``EngineBench``: what the sections of ``bench/engine/engine_bench.py`` share instead of module globals - the
settings, the weights (built once), the engine a section asks for (one per configuration: a
section that compares two configurations runs two engines over the same weights), section a's
ceilings, the results, and ``timed`` (repetitions inside which the engine compiled are dropped
and counted).
"""

from __future__ import annotations

import time

LLAMA3_8B = dict(vocab=128256, hidden=4096, inter=14336, layers=32, heads=32, kv=8, head_dim=128,
                 theta=500000.0, max_pos=32768, eps=1e-5)
LLAMA3_70B = dict(vocab=128256, hidden=8192, inter=28672, layers=80, heads=64, kv=8, head_dim=128,
                  theta=500000.0, max_pos=32768, eps=1e-5)
TINY = dict(vocab=512, hidden=64, inter=128, layers=2, heads=4, kv=2, head_dim=16,
            theta=500000.0, max_pos=2048, eps=1e-5)


H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s, NVIDIA H200 SXM datasheet (no sparsity)


def shape(quick: bool, **over) -> dict:
    """The tiny shape for ``--quick`` runs, else Llama-3-8B; ``over`` replaces fields."""
    return dict(TINY if quick else LLAMA3_8B, **over)


def model_config(sh: dict):
    from models import ModelConfig, RopeConfig

    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=sh["vocab"], hidden_size=sh["hidden"],
                       intermediate_size=sh["inter"], num_layers=sh["layers"], num_heads=sh["heads"],
                       num_kv_heads=sh["kv"], head_dim=sh["head_dim"], rms_norm_eps=sh.get("eps", 1e-5),
                       rope=RopeConfig(theta=sh.get("theta", 500000.0)), max_position_embeddings=sh["max_pos"])


def back_to_back(fn, reps: int = 10, inner: int = 10) -> float:
    """Seconds per call of ``fn()``: the median over ``reps`` of ``inner`` calls issued back to back and
    then waited for, divided by ``inner`` - the host's dispatch and the wait overlap the device's work
    instead of adding to each call (timing one call at a time adds ~0.1-0.3 ms to a sub-ms kernel on the
    H200, bench/NOTES.md).  ``fn`` must return a jax value; call it once first to compile."""
    import jax
    import numpy as np

    times = []
    for _ in range(reps):
        t = time.perf_counter()
        outs = [fn() for _ in range(inner)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t) / inner)
        del outs
    return float(np.median(times))


def paged_decode_inputs(batch: int, ctx: int, hq: int, hkv: int, d: int, s: int):
    """(q, k_pages, v_pages, page_table, lengths) of a decode step: ``batch`` sequences of ``ctx`` tokens
    each on their own consecutive pages (page 0 left as the null page), random bf16 values."""
    import jax
    import jax.numpy as jnp

    per = ctx // s
    k1, k2 = jax.random.split(jax.random.PRNGKey(batch))
    k = jax.random.normal(k1, (hkv, batch * per + 1, s, d)).astype(jnp.bfloat16)
    v = jax.random.normal(k2, (hkv, batch * per + 1, s, d)).astype(jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, hq, d)).astype(jnp.bfloat16)
    table = (1 + jnp.arange(batch * per, dtype=jnp.int32)).reshape(batch, per)
    return q, k, v, table, jnp.full((batch,), ctx, jnp.int32)


def read_bandwidth(num_bytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes/s of reading ``num_bytes`` of bf16 once: the fastest of three float32-accumulating
    reductions (the whole array to a scalar, rows of 4096 to one value each, and the columns of
    each 2048-row block), median of ``reps`` each.  The writes are at most 1/1024 of the reads.  The best form is
    taken so that the ceiling is as hard as this device shows it can be (a slow reduction would
    flatter a read-bound kernel compared with it)."""
    import jax
    import jax.numpy as jnp

    n = num_bytes // 2
    x = jax.random.normal(jax.random.PRNGKey(5), (max(1, n // (2048 * 4096)) * 2048, 4096), jnp.bfloat16)
    forms = {"all": lambda a: jnp.sum(a, dtype=jnp.float32),
             "rows": lambda a: jnp.sum(a, axis=1, dtype=jnp.float32),
             "columns of 2048-row blocks": lambda a: jnp.sum(a.reshape(-1, 2048, 4096), axis=1, dtype=jnp.float32)}
    best = 0.0
    for f in forms.values():
        g = jax.jit(f)
        g(x).block_until_ready()
        best = max(best, x.nbytes / back_to_back(lambda g=g, x=x: g(x), reps))
    del x
    return best


def matmul_ceiling(n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of a jitted ``n x n @ n x n`` bf16 matmul with float32 accumulation (median of ``reps``
    of a chain of 4 in one executable, so the launch stays out)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16) / n ** 0.5

    @jax.jit
    def chain(x, y):
        for _ in range(4):
            x = jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return x

    chain(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        chain(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 4 * 2 * n ** 3 / float(np.median(times))


def start_kernel_bench(args, log) -> float:
    """A kernel benchmark's start: ``args.out`` made absolute and created, the devices logged, the run's read and
    matmul ceilings measured into ``args.ceiling`` / ``args.tflops`` (round stand-ins with ``args.smoke``: the
    CPU); returns the start time."""
    import os

    import jax
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    log(f"devices: {jax.devices()}  jax {jax.__version__}")
    args.ceiling = read_bandwidth() if not args.smoke else 1e12
    args.tflops = matmul_ceiling() if not args.smoke else 1e14
    log(f"read ceiling {args.ceiling / 1e12:.2f} TB/s, matmul ceiling {args.tflops / 1e12:.0f} TFLOP/s")
    return t0


def param_counts(sh: dict) -> tuple[int, int]:
    """(parameters every token's matmuls use - attention, MLP and the LM head -, embedding table)."""
    h, d = sh["hidden"], sh["head_dim"]
    attn = h * d * (sh["heads"] + 2 * sh["kv"]) + sh["heads"] * d * h
    mlp = 3 * h * sh["inter"]
    return sh["layers"] * (attn + mlp) + sh["vocab"] * h, sh["vocab"] * h


def step_read_bytes(sh: dict, bytes_per_param: int = 2) -> int:
    """Bytes of weights a forward step must read: all but the embedding table (norms are noise)."""
    return param_counts(sh)[0] * bytes_per_param


def forward_flops(sh: dict, T: int, C: int = 0, lm_head_tokens: int | None = None) -> float:
    """FLOPs of one forward over T new tokens after C cached ones: the layers' matmuls for every token,
    the LM head for ``lm_head_tokens`` (default T; a prefill chunk needs only its last), and causal
    attention's QK^T and PV over the unmasked pairs, T*C + T*(T+1)/2 per head per layer."""
    used, _ = param_counts(sh)
    head = sh["vocab"] * sh["hidden"]
    lm = T if lm_head_tokens is None else lm_head_tokens
    pairs = T * C + T * (T + 1) / 2
    attn = 4 * sh["layers"] * sh["heads"] * sh["head_dim"] * pairs
    return 2 * (used - head) * T + 2 * head * lm + attn


def floor_s(nbytes: float, flops: float, bandwidth: float | None, compute: float | None) -> float | None:
    """The roofline floor: the larger of the time to read ``nbytes`` and to compute ``flops``."""
    parts = [x for x in ((nbytes / bandwidth) if bandwidth else None,
                         (flops / compute) if compute else None) if x is not None]
    return max(parts) if parts else None


# ---------------------------------------------------------------- the engine benchmark's shared state

def ms(sec) -> str:
    return "n/a" if sec is None else f"{sec * 1e3:.2f}"


def ratio(a, b) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def median(xs):
    import statistics
    return statistics.median(xs) if xs else None


def pct(xs, p):
    import numpy as np
    return float(np.percentile(xs, p)) if len(xs) else None


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"32x4096,128x4096"`` -> ``[(32, 4096), (128, 4096)]`` (the kernel benchmarks' ``BxCTX`` lists)."""
    return [tuple(int(x) for x in sh.split("x")) for sh in text.split(",")]


def kv_token_bytes(cfg, kv_dtype: str | None = None) -> int:
    """KV bytes of one token, K and V of every layer, as the engine stores them (``kv_cache.page_bytes``:
    a compressed ``kv_dtype`` holds one byte per value plus a float32 scale per row); None: bf16."""
    from inferscale_jax.kv_cache import page_bytes

    return page_bytes(cfg, 1, kv_dtype or "bfloat16")


def greedy(max_tokens: int):
    from inferscale_jax.sampling import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class EngineBench:
    """What the sections of ``bench/engine/engine_bench.py`` share, passed to each (no module globals): the
    settings, the model (random bf16 weights built once), the engine a section asks for, the
    device ceilings section a measured, the results and the failures.

    ``engine(**config)`` returns an engine with those ``EngineConfig`` fields over the base
    settings: the current one when its config is the same, else the current one is dropped (its
    page pool freed) and a new one built on the same weights - so a section that compares two
    configurations (cascade decode on / off) runs two engines, one after the other, instead of
    changing a live engine's config."""

    def __init__(self, quick: bool, settings: dict, base_config: dict, log, failures: list):
        import numpy as np

        self.quick, self.s, self.base_config = quick, settings, dict(base_config)
        self.log, self.failures = log, failures
        self.sh = shape(quick)
        self.cfg = model_config(self.sh)
        self.rng = np.random.default_rng(1234)
        self.R: dict = {}
        self.copy_bw = self.read_bw = self.mm_flops = None
        self.params = None
        self._engine = None
        self._engine_kw = None
        self.engines_built = 0
        self.compiles_total = 0  # over every engine of the run
        self.segments: dict = {}  # L -> token ids of seg{L} in the current engine
        self.dropped_reps = 0

    # ---- model and engines
    def weights(self):
        if self.params is None:
            import jax
            import jax.numpy as jnp
            from models import init_params

            t0 = time.time()
            self.params = init_params(self.cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
            jax.block_until_ready(self.params)
            n = sum(x.size for x in jax.tree_util.tree_leaves(self.params))
            self.log(f"params: {n / 1e9:.3f} B, {n * 2 / 1e9:.2f} GB, init {time.time() - t0:.1f} s")
        return self.params

    def engine(self, **config):
        from inferscale_jax.config import EngineConfig
        from inferscale_jax.engine import Engine

        kw = dict(self.base_config, **config)
        if self._engine is not None and kw == self._engine_kw:
            return self._engine
        params = self.weights()
        self.drop_engine()
        t0 = time.time()
        self._engine = Engine(params, self.cfg, None, EngineConfig(**kw))
        self._engine_kw = kw
        self.engines_built += 1
        self.log(f"engine #{self.engines_built}: {kw}, attention {self._engine.stats()['attention_impl']}, "
                 f"{time.time() - t0:.1f} s")
        return self._engine

    def drop_engine(self):
        import gc

        if self._engine is not None:
            self.compiles_total += self._engine.compiles
            self._engine = None
            self._engine_kw = None
            self.segments.clear()
            gc.collect()

    @property
    def current(self):
        return self._engine

    # ---- inputs and ceilings
    def fresh(self, n: int) -> list[int]:
        """New random token ids (never repeats a prefix: no prefix-cache hits)."""
        return self.rng.integers(0, self.cfg.vocab_size, n).tolist()

    def bandwidth(self):
        """Bytes/s the read-bound floors use: the fastest this device moved in section a (the larger
        of the read-only and copy figures: the hardest floor the run supports); None before it."""
        bws = [b for b in (self.copy_bw, self.read_bw) if b]
        return max(bws) if bws else None

    def step_read_bytes(self) -> int:
        return step_read_bytes(self.sh)

    def floor(self, T: int, C: int = 0, lm_head_tokens: int | None = None, compute: float | None = None):
        """The roofline floor of one forward of T tokens over C cached: max(weights a step reads /
        bandwidth, its FLOPs / the measured matmul ceiling, or ``compute``)."""
        return floor_s(self.step_read_bytes(), forward_flops(self.sh, T, C, lm_head_tokens), self.bandwidth(),
                       compute or self.mm_flops)

    # ---- timed repetitions
    def timed(self, eng, fn, reps: int, label: str) -> list:
        """``timed_reps``, counting the dropped repetitions for the report."""
        out = timed_reps(eng, fn, reps, label, self.log)
        self.dropped_reps += reps - len(out)
        return out

    def drop_segments(self, eng, names):
        for name in names:
            try:
                eng.delete_segment(name)
            except Exception as e:  # noqa: BLE001 - reported; the next section goes on
                self.log(f"  could not delete {name}: {e!r}")


def timed_reps(eng, fn, reps: int, label: str, log=print) -> list:
    """``reps`` results of ``fn()``; a repetition inside which the engine compiled is dropped and
    reported (its time would include the compile).  Raises when every one compiled."""
    out = []
    for _ in range(reps):
        c0 = eng.compiles
        r = fn()
        if eng.compiles != c0:
            log(f"  WARNING {label}: a timed repetition compiled {eng.compiles - c0} bucket(s); dropped")
            continue
        out.append(r)
    if reps and not out:
        raise RuntimeError(f"{label}: every timed repetition compiled")
    return out


def copy_bandwidth(num_bytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes/s (read + written) of a device copy of ``num_bytes`` of bf16 (median of ``reps``)."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.PRNGKey(7), (num_bytes // 2,), jnp.bfloat16)
    cp = jax.jit(lambda a: jax.lax.optimization_barrier(a).copy())
    cp(x).block_until_ready()
    return 2 * x.nbytes / back_to_back(lambda: cp(x), reps, inner=4)  # 4 copies in flight at most


def timed_generate(eng, ids, segs, max_tokens: int = 1, mode: str | None = None):
    """(output, wall seconds) of one greedy ``generate``."""
    from inferscale_jax.sampling import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    kw = {} if mode is None else {"mode": mode}
    t0 = time.perf_counter()
    out = eng.generate(prompt_token_ids=ids, segments=segs, sampling=sp, **kw)
    return out, time.perf_counter() - t0


def abort_all(eng, ids):
    """Free the pages of requests left unfinished by an error (the next section starts clean)."""
    for rid in ids:
        try:
            eng.abort(rid)
        except Exception:  # noqa: BLE001
            pass
