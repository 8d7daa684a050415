"""The engine's whole jitted steps lower to Triton for CUDA on this CPU host.

Interpret mode (every kernel test on the CPU) never runs Pallas' Triton lowering, and that lowering
refuses programs interpret mode accepts: run AU (bench/NOTES.md) lost a GPU call to a scalar
``jnp.where(bool, int, int)`` that Triton typed i1.  Here the engine's own step buckets, with the
production head shape (head_dim 128, four query heads per kv head, 16-token pages, bf16), are traced
with the kernels' compiled path (``common.default_interpret`` patched to False, as on a GPU) and
lowered for ``cuda``: decode steps with and without cascade groups, mixed steps with and without,
log-prob buckets, the multi-step decode loop, compressed KV pages, and the A/B switches' kernel forms.
Each lowering also names the kernels it launches, so a switch that silently changes nothing fails.
Lowering is not compiling: a kernel that lowers can still fail in ptxas on the GPU (registers,
shared memory); ``bench/tools/rerun_h200.sh`` runs the GPU-side checks.
"""

from __future__ import annotations

import re

import jax
import pytest

from inferscale_jax import Engine, EngineConfig
from inferscale_jax import decode_loop as decode_loop_mod
from inferscale_jax import kv_cache
from inferscale_jax import runner as runner_mod
from inferscale_jax.buckets import StepKey
from inferscale_jax.decode_loop import pack_stops
from inferscale_jax.runner import StepPlan
from models import ModelConfig, RopeConfig, init_params
from pallas_kernels import common

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=97, hidden_size=256, intermediate_size=512,
                  num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-5,
                  rope=RopeConfig(), max_position_embeddings=4096)


@pytest.fixture
def compiled_kernels(monkeypatch):
    """The kernels' GPU path on this host, and no stale traces (a switch is read when a step is traced)."""
    monkeypatch.setattr(common, "default_interpret", lambda: False)
    jax.clear_caches()
    yield
    jax.clear_caches()


def make_engine(**kw) -> Engine:
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    return Engine(params, CFG, None, EngineConfig(**{"dtype": "bfloat16", "page_size": 16, "hbm_pages": 256,
                                                     "max_batch": 16, "attention_impl": "pallas",
                                                     "cascade_decode": True, **kw}))


def kinds(engine) -> dict[str, StepKey]:
    """One bucket of each kind the engine warms up (``buckets.all_keys``)."""
    keys = engine.runner.buckets.all_keys()
    pick = {
        "decode": lambda k: not k.ragged and not k.shared and not k.num_logprobs,
        "decode, cascade": lambda k: not k.ragged and k.shared and k.groups > 1,
        "mixed": lambda k: k.ragged and not k.shared and k.tokens > k.rows,
        "mixed, cascade": lambda k: k.ragged and k.shared and k.tokens > k.rows,
        "mixed, cascade, log-probs": lambda k: k.ragged and k.shared and k.num_logprobs,
    }
    return {name: next(k for k in keys if want(k)) for name, want in pick.items()}


def lowered_kernels(engine, key: StepKey, loop_steps: int = 0) -> set[str]:
    """Lower bucket ``key``'s step (or its ``loop_steps``-step decode loop) for CUDA, as the warm-up builds
    it on padding; returns the Pallas kernels the lowered module launches."""
    return set(re.findall(r'name = "([a-z]\w*)"', lowered_text(engine, key, loop_steps)))


def launch_params(engine, key: StepKey) -> dict[str, tuple[int, int]]:
    """The Pallas kernels of bucket ``key``'s lowered step: name -> (num_stages, num_warps)."""
    found = re.findall(r'name = "([a-z]\w*)", num_stages = (\d+) : i32, num_warps = (\d+)', lowered_text(engine, key))
    return {name: (int(st), int(w)) for name, st, w in found}


def lowered_text(engine, key: StepKey, loop_steps: int = 0) -> str:
    r = engine.runner
    rows = r._padding_rows(key)
    groups = r._padding_groups(key)
    if loop_steps and not key.shared:  # (as Runner.warmup_loops: the widest row ends where its table does)
        rows[0].start = max(0, key.width * r.page_size - loop_steps)
    _, _, host = r._pack(rows, key.num_logprobs, groups, None, *((loop_steps,) if loop_steps else ()))
    if loop_steps:
        plan = StepPlan(rows, key.num_logprobs, groups, steps=loop_steps, stops=[([1], 1)] * len(rows))
        args = r._to_device(host[:3] + (pack_stops(plan.stops, key.rows),))
        traced = decode_loop_mod._decode_loop.trace(r.params, r.cache, *args, cfg=r.cfg, key=key, steps=loop_steps,
                                                    size=r.max_batch, precision=r.matmul_precision)
    else:
        traced = runner_mod._model_step.trace(r.params, r.cache, *r._to_device(host), cfg=r.cfg, key=key,
                                              precision=r.matmul_precision)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
    return text


def test_every_kind_of_step_lowers(compiled_kernels):
    engine = make_engine()
    found = {name: lowered_kernels(engine, key) for name, key in kinds(engine).items()}
    assert all(any(n.startswith("write_kv") for n in k) for k in found.values()), found
    assert not any(n.startswith("ragged") for n in found["decode"]), found["decode"]
    assert any(n.startswith("cascade_") for n in found["decode, cascade"]), found["decode, cascade"]
    for name in ("mixed", "mixed, cascade", "mixed, cascade, log-probs"):
        assert any(n.startswith("ragged_paged_attention") for n in found[name]), (name, found[name])
    assert any(n.startswith("cascade_shared") for n in found["mixed, cascade"]), found["mixed, cascade"]


@pytest.mark.parametrize("spec,form", [
    ("", "split_longest"),  # the default: the longest blocks split, then merged in place
    ("sp=4", "split_longest"),
    ("sp=4,sl=0", "every block split"),
    ("sp=1", "unsplit"),
])
def test_the_mixed_ragged_forms_lower(compiled_kernels, monkeypatch, spec, form):
    """``INFERSCALE_MIXED_RAGGED``'s kernel forms in a mixed cascade step (the C = 64 step's kind)."""
    monkeypatch.setenv("INFERSCALE_MIXED_RAGGED", spec)
    engine = make_engine()
    names = lowered_kernels(engine, kinds(engine)["mixed, cascade"])
    ragged = {n for n in names if n.startswith("ragged_")}
    merged = any(n.startswith("ragged_merge") for n in ragged)
    split = any(re.search(r"_s([2-9]|\d\d)", n) for n in ragged)
    assert {"split_longest": merged and split, "every block split": split and not merged,
            "unsplit": not split and not merged}[form], (spec, ragged)


def test_the_mixed_merge_lowers_inside_the_ragged_kernel(compiled_kernels, monkeypatch):
    """A mixed cascade step's ragged kernel starts from the shared part's split partials (its name ends in
    ``_i<splits>``, the splits the shared part ran), so no jnp merge follows it; ``INFERSCALE_MIXED_MERGE=jnp``
    lowers the earlier form (the ragged kernel without partials)."""
    engine = make_engine()
    key = kinds(engine)["mixed, cascade"]
    names = lowered_kernels(engine, key)
    shared = {re.search(r"_sp(\d+)(?:_nq)?$", n).group(1) for n in names if n.startswith("cascade_shared")}
    started = {re.search(r"_i(\d+)(?:_sl)?$", n).group(1) for n in names if n.startswith("ragged_paged_attention")}
    assert len(shared) == 1 and started == shared, names
    jax.clear_caches()
    base = common.switches()
    monkeypatch.setenv("INFERSCALE_MIXED_MERGE", "jnp")
    assert common.switches() != base  # (the executable store's key follows the switch)
    names = lowered_kernels(make_engine(), key)
    assert not any(re.search(r"_i\d+(?:_sl)?$", n) for n in names)
    assert any(n.startswith("cascade_shared") for n in names)


def test_the_norm_kernel_lowers_in_every_kind_of_step(compiled_kernels, monkeypatch):
    """``INFERSCALE_NORM=pallas``: a layer's two residual adds + norms in the kernel in every kind of step (the
    layer's nested jit is lowered once, so its function holds both calls of the kernel's function); none in the
    default mixed step."""
    monkeypatch.delenv("INFERSCALE_NORM", raising=False)
    engine = make_engine()
    default = lowered_kernels(engine, kinds(engine)["mixed, cascade"])
    assert not any("rms_norm" in n for n in default), default
    jax.clear_caches()
    monkeypatch.setenv("INFERSCALE_NORM", "pallas")
    engine = make_engine()
    for name, key in kinds(engine).items():
        text = lowered_text(engine, key)
        assert re.search(r'name = "add_rms_norm_r\d+"', text) and text.count("call @add_rms_norm_pallas(") >= 2, name


def test_the_rope_kernel_lowers_in_every_kind_of_step(compiled_kernels, monkeypatch):
    """Every kind of step splits q / k / v and applies RoPE in ``qkv_rope`` by default; ``INFERSCALE_ROPE=jnp``
    leaves it to XLA."""
    monkeypatch.delenv("INFERSCALE_ROPE", raising=False)
    engine = make_engine()
    for name, key in kinds(engine).items():
        assert any(n.startswith("qkv_rope") for n in lowered_kernels(engine, key)), name
    jax.clear_caches()
    monkeypatch.setenv("INFERSCALE_ROPE", "jnp")
    engine = make_engine()
    assert not any(n.startswith("qkv_rope") for n in lowered_kernels(engine, kinds(engine)["mixed, cascade"]))


def test_the_matmul_kernel_lowers_in_decode_sized_steps(compiled_kernels, monkeypatch):
    """By default (``INFERSCALE_MATMUL=pallas``) a layer's four projections run in the skinny-matmul kernel in every
    kind of step of ``MATMUL_MIN_ROWS``-``MATMUL_MAX_ROWS`` tokens (the layer's nested jit holds the four calls);
    none under ``xla``, and none under the floor.  (This engine's decode steps are under the floor: it is lowered to
    1 but for that check.  bf16 weights, as a checkpoint's: make_engine's random ones are float32, which the kernel
    does not take.)"""
    import inferscale_jax.kv_cache as kv_cache_mod
    from inferscale_jax.kv_cache import MATMUL_MAX_ROWS

    def bf16_engine():
        engine = make_engine()
        engine.runner.params = jax.tree.map(lambda a: a.astype("bfloat16"), engine.runner.params)
        return engine

    def calls(text):
        return len(re.findall(r"call @matmul_pallas(?:_\d+)?\(", text))

    monkeypatch.delenv("INFERSCALE_MATMUL", raising=False)
    engine = bf16_engine()
    assert kinds(engine)["decode"].tokens < kv_cache_mod.MATMUL_MIN_ROWS
    assert calls(lowered_text(engine, kinds(engine)["decode"])) == 0
    jax.clear_caches()
    monkeypatch.setattr(kv_cache_mod, "MATMUL_MIN_ROWS", 1)
    monkeypatch.setenv("INFERSCALE_MATMUL", "xla")
    engine = bf16_engine()
    assert calls(lowered_text(engine, kinds(engine)["decode"])) == 0
    jax.clear_caches()
    monkeypatch.delenv("INFERSCALE_MATMUL")
    engine = bf16_engine()
    for name, key in kinds(engine).items():
        assert key.tokens <= MATMUL_MAX_ROWS, (name, key)  # (this engine's buckets: all decode-sized)
        text = lowered_text(engine, key)
        assert re.search(r'name = "matmul_n\d+_k\d+(?:_s\d+)?"', text) and calls(text) == 4, name


def test_the_cascade_mixed_decode_lowers(compiled_kernels, monkeypatch):
    """``INFERSCALE_MIXED_DECODE=cascade``: a mixed step's one-token rows in the decode step's cascade kernel
    (its private part, ``paged_decode``, which the default mixed step does not launch), the chunks ragged."""
    engine = make_engine()
    default = lowered_kernels(engine, kinds(engine)["mixed, cascade"])
    jax.clear_caches()  # (the switch is read when a step is traced)
    monkeypatch.setenv("INFERSCALE_MIXED_DECODE", "cascade")
    engine = make_engine()
    names = lowered_kernels(engine, kinds(engine)["mixed, cascade"])
    assert not any(n.startswith("paged_decode") for n in default), default
    assert any(n.startswith("paged_decode") for n in names), names
    assert any(n.startswith("ragged_paged_attention") for n in names), names


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_compressed_pages_lower(compiled_kernels, kv_dtype):
    """Every kind of step over int8 / float8 pages: the quantizing KV write, and the mixed steps' ragged kernel."""
    engine = make_engine(kv_dtype=kv_dtype)
    for name, key in kinds(engine).items():
        names = lowered_kernels(engine, key)
        assert any(n.startswith("write_kv_quantized") for n in names), (name, names)
        assert any(n.startswith("ragged_paged_attention") for n in names) == key.ragged, (name, names)


def test_the_decode_loop_lowers(compiled_kernels):
    """Multi-step decode (``--decode-steps``): the loop of decode steps, plain and cascade buckets."""
    engine = make_engine(decode_steps=4)
    for name in ("decode", "decode, cascade"):
        names = lowered_kernels(engine, kinds(engine)[name], loop_steps=4)
        assert any(n.startswith("paged_decode") for n in names), (name, names)
        assert any(n.startswith("cascade_shared") for n in names) == (name == "decode, cascade"), (name, names)


def shared_splits(engine, want) -> int:
    """The split count of the cascade shared part in the first bucket ``want(key)`` picks, as lowered for CUDA."""
    key = next(k for k in engine.runner.buckets.all_keys() if want(k))
    found = {int(m) for n in lowered_kernels(engine, key)
             for m in re.findall(r"^cascade_shared\w*_sp(\d+)(?:_nq)?$", n)}  # (_nq: normalised 16-bit partials)
    assert len(found) == 1, (key, found)
    return found.pop()


def test_the_mixed_shared_split_count_follows_the_token_bucket(compiled_kernels, monkeypatch):
    """A mixed step's shared part splits by its token bucket (``kv_cache.MIXED_SPLIT_BUCKETS``: 2 from 128
    tokens, 3 from 256, 2 from 512, 1 from 1024, for 8 kv heads on the device, proportionally more for fewer;
    below 128, the automatic count); ``INFERSCALE_MIXED_SHARED``'s ``sp`` overrides it."""
    def splits(engine, tokens):
        return shared_splits(engine, lambda k: k.ragged and k.shared and k.tokens == tokens)
    engine = make_engine()  # (CFG: 2 kv heads, so 4x the 8-head counts)
    assert [splits(engine, t) for t in (128, 256, 512, 1024, 2048)] == [8, 12, 8, 4, 4]
    below = splits(engine, 64)
    jax.clear_caches()
    monkeypatch.setattr(kv_cache, "MIXED_SPLIT_BUCKETS", ())  # the kernel's automatic count everywhere
    assert splits(make_engine(), 64) == below and splits(make_engine(), 512) not in (8, 4)
    jax.clear_caches()
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", "sp=3")
    assert splits(make_engine(), 512) == 3


def test_the_mixed_cascade_steps_ragged_kernel_runs_one_stage(compiled_kernels, monkeypatch):
    """A mixed step with cascade groups of at most ``kv_cache.MIXED_RAGGED_CASCADE_MAX_TOKENS`` tokens runs its ragged
    kernel at ``kv_cache.MIXED_RAGGED_CASCADE_STAGES`` (1) stages (its decode rows read only their private keys there:
    bench/NOTES.md, run BB); a bigger cascade bucket, a mixed step without groups and fp32 pages keep the kernel's
    own choice (2 or 3 by its tokens); ``INFERSCALE_MIXED_RAGGED``'s ``st`` overrides the count."""
    def stages(engine, cascade=True, big=False):
        cap = kv_cache.MIXED_RAGGED_CASCADE_MAX_TOKENS
        key = next(k for k in engine.runner.buckets.all_keys()
                   if k.ragged and bool(k.shared) == cascade and (k.groups > 1 or not cascade)
                   and (k.tokens > cap if big else 128 <= k.tokens <= cap))
        found = {st for name, (st, _) in launch_params(engine, key).items()
                 if name.startswith("ragged_paged_attention")}
        assert found, key
        return found
    monkeypatch.setattr(kv_cache, "MIXED_RAGGED_CASCADE_MAX_TOKENS", 128)  # (the test engine's buckets are small)
    engine = make_engine()
    assert stages(engine) == {1}
    assert 1 not in stages(engine, big=True)
    assert 1 not in stages(engine, cascade=False)
    jax.clear_caches()
    monkeypatch.setenv("INFERSCALE_MIXED_RAGGED", "st=2")
    assert stages(make_engine()) == {2}
    monkeypatch.delenv("INFERSCALE_MIXED_RAGGED")
    monkeypatch.setattr(common, "default_interpret", lambda: False)
    jax.clear_caches()
    assert 1 not in stages(make_engine(dtype="float32"))


def test_the_mixed_shared_part_runs_three_pipeline_stages(compiled_kernels, monkeypatch):
    """A mixed step's shared part runs ``kv_cache.MIXED_SHARED_STAGES`` (3) stages, where the kernel's own
    default is 2 (measured faster, bench/NOTES.md run AW), on K/V tiles up to the measured one's bytes (64
    tokens x 128 x bf16); fp32 pages or a 128-token tile keep the kernel's default; the decode step's cascade
    kernel runs ``kv_cache.DECODE_SHARED_STAGES`` (3, run AX) under the same gate; ``INFERSCALE_MIXED_SHARED``'s
    ``st`` overrides the mixed steps' count."""
    def stages(engine, mixed=True):
        key = next(k for k in engine.runner.buckets.all_keys()
                   if k.ragged == mixed and k.shared and k.groups > 1 and k.tokens >= 128 * mixed)
        found = {st for name, (st, _) in launch_params(engine, key).items() if name.startswith("cascade_")}
        assert found, key
        return found
    engine = make_engine()
    assert stages(engine) == {3} and stages(engine, mixed=False) == {3}
    jax.clear_caches()
    monkeypatch.setattr(kv_cache, "MIXED_SHARED_STAGES", None)  # the kernel's own default
    assert stages(make_engine()) == {2} and stages(make_engine(), mixed=False) == {3}
    jax.clear_caches()
    monkeypatch.setattr(kv_cache, "DECODE_SHARED_STAGES", None)
    assert stages(make_engine(), mixed=False) == {2}
    monkeypatch.undo()
    monkeypatch.setattr(common, "default_interpret", lambda: False)
    jax.clear_caches()
    fp32 = make_engine(dtype="float32")  # (a 64 x 128 fp32 tile: twice the measured bytes)
    assert stages(fp32) == {2} and stages(fp32, mixed=False) == {2}
    jax.clear_caches()
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", "bk=128")
    assert stages(make_engine()) == {2}
    jax.clear_caches()
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", "st=4")
    assert stages(make_engine()) == {4}


def test_the_mixed_shared_chunk_launch_lowers(compiled_kernels, monkeypatch):
    """``INFERSCALE_MIXED_SHARED=cb=128,cw=8``: a mixed step's shared part as two launches, the one-token rows'
    in 64-row blocks and the chunks' in 128-row blocks of 8 warps (both 3 stages)."""
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", "cb=128,cw=8")
    engine = make_engine()
    key = next(k for k in engine.runner.buckets.all_keys() if k.ragged and k.shared and k.tokens == 512)
    shared = {re.sub(r"_g\d+", "", name): params for name, params in launch_params(engine, key).items()
              if name.startswith("cascade_shared")}
    assert shared == {"cascade_shared_r64_bk64_sp8_nq": (3, 4), "cascade_shared_r128_bk64_sp8_nq": (3, 8)}, shared


def test_the_decode_shared_split_count_follows_the_row_bucket(compiled_kernels, monkeypatch):
    """A decode step's cascade shared part splits 2 ways from 256 rows (``kv_cache.DECODE_SPLIT_BUCKETS``, for 8 kv
    heads: 8 for the test model's 2), below that by the kernel's automatic count."""
    def splits(engine, rows):
        return shared_splits(engine, lambda k: not k.ragged and k.shared and k.rows == rows and not k.num_logprobs)
    assert [kv_cache.decode_shared_splits(r, 8) for r in (64, 255, 256, 512)] == [None, None, 2, 2]
    monkeypatch.setattr(kv_cache, "DECODE_SPLIT_BUCKETS", ((16, 2),))  # (the test engine's rows: at most 16)
    engine = make_engine()
    assert splits(engine, 16) == 8
    jax.clear_caches()
    monkeypatch.setattr(kv_cache, "DECODE_SPLIT_BUCKETS", ())
    assert splits(make_engine(), 16) != 8


def test_the_mixed_shared_split_count_scales_with_the_devices_kv_heads():
    """8 kv heads on the device take the measured counts; fewer (tensor parallelism) proportionally more."""
    assert [kv_cache.mixed_shared_splits(t, 8) for t in (64, 128, 256, 511, 512, 1024, 4096)] == [
        None, 2, 3, 3, 2, 1, 1]
    assert [kv_cache.mixed_shared_splits(t, h) for t, h in ((128, 4), (128, 1), (2048, 2), (2048, 16))] == [4, 16, 4, 1]
