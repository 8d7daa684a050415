"""Matmul precision reaches the model's dots (docs/architecture.md: fp32 means fp32).

On a CPU every float32 dot is exact whatever the precision says, so these tests read the
lowered step instead: the dots of a "highest" step carry ``precision = [HIGHEST, HIGHEST]``,
those of a "default" step ``[DEFAULT, DEFAULT]`` (the model's weight dots; the reference
attention kernels ask for HIGHEST on their own).  The GPU effect is bench/engine/precision.py's."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inferscale_jax.dense_generate as dense_generate
from inferscale_jax import EngineConfig, SamplingParams
from inferscale_jax.kv_cache import PagedKVCache
from inferscale_jax.runner import ModelRunner, StepRow
from models import init_params, inv_freq
from tests.support.tiny_engine import CFG, S, make_engine


def dot_precisions(hlo: str) -> set[str]:
    """The operand precisions of the model's weight dots (a 2-D right operand: projections, MLP,
    LM head) in a lowered module's text; the reference attention's dots say HIGHEST themselves."""
    line = re.compile(r"dot_general.*precision = \[(\w+), \w+\] : \(tensor<[\dx]*\w+>, tensor<\d+x\d+x[a-z]+\d+>\)")
    found = {m.group(1) for m in map(line.search, hlo.splitlines()) if m}
    assert found, "no weight dot found in the lowered step"
    return found


def lowered_step(monkeypatch, runner: ModelRunner, rows: list[StepRow]) -> str:
    """Run one step through the runner and return the text of the ``_model_step`` it compiled."""
    seen = []
    real = runner._lower

    def spy(*args, **kwargs):
        lowered = real(*args, **kwargs)
        seen.append(lowered.as_text())
        return lowered

    monkeypatch.setattr(runner, "_lower", spy)
    runner.step(rows)
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_passes_the_resolved_precision_into_the_model(monkeypatch, dtype):
    precision = EngineConfig(dtype=dtype).resolved_matmul_precision  # float32: highest, bf16: default
    params = init_params(CFG, jax.random.PRNGKey(0), dtype=jnp.dtype(dtype), scale=0.5)
    cache = PagedKVCache.create(CFG, 16, S, jnp.dtype(dtype), "ref")
    runner = ModelRunner(params, CFG, cache, max_batch=4, prefill_chunk=16, max_pages_per_seq=8,
                         inv_freq=inv_freq(CFG.rope, CFG.head_dim), matmul_precision=precision)
    rows = [StepRow([3, 4, 5], 0, [1]), StepRow([6], 0, [2])]
    dots = dot_precisions(lowered_step(monkeypatch, runner, rows))
    assert dots == ({"HIGHEST"} if dtype == "float32" else {"DEFAULT"}), dots


def test_runner_precision_is_part_of_the_compile_key():
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    runner = ModelRunner(params, CFG, PagedKVCache.create(CFG, 16, S, jnp.float32, "ref"), max_batch=4,
                         prefill_chunk=16, max_pages_per_seq=8, inv_freq=inv_freq(CFG.rope, CFG.head_dim),
                         matmul_precision="highest")
    row = [StepRow([3, 4, 5], 0, [1])]
    runner.step(row)
    compiled = runner.compiles
    runner.matmul_precision = "default"  # same shapes: must not reuse the "highest" executable
    runner.step(row)
    assert runner.compiles == compiled + 1
    assert {p for (_, _, p) in runner.executables} == {"highest", "default"}


def test_engine_hands_its_precision_to_the_runner():
    assert make_engine().runner.matmul_precision == "highest"  # float32 engine, precision None
    assert make_engine(matmul_precision="high").runner.matmul_precision == "high"


@pytest.mark.parametrize("dtype,matmul_precision,want", [
    (jnp.float32, None, "HIGHEST"), (jnp.bfloat16, None, "DEFAULT"), (jnp.float32, "default", "DEFAULT")])
def test_dense_generate_runs_at_the_resolved_precision(monkeypatch, dtype, matmul_precision, want):
    seen = set()
    real = dense_generate._step

    def spy(*args, **kwargs):
        seen.update(dot_precisions(real.lower(*args, **kwargs).as_text()))
        return real(*args, **kwargs)

    monkeypatch.setattr(dense_generate, "_step", spy)
    params = init_params(CFG, jax.random.PRNGKey(0), dtype=dtype, scale=0.5)
    out, _ = dense_generate.generate_dense(params, CFG, [3, 4, 5], SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True), dtype, matmul_precision=matmul_precision)
    assert len(out) == 2 and seen == {want}, seen


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU property: a GPU's 'default' is TF32 (the point)")
def test_precision_does_not_change_cpu_results():
    """The same tokens and log-probs either way on the CPU (its float32 dots are exact): the
    precision scope changes nothing else in the step."""
    engine = make_engine()
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    engine.runner.matmul_precision = "default"
    a = engine.generate(prompt_token_ids=[3, 4, 5, 6], sampling=sp)
    engine.runner.matmul_precision = "highest"
    b = engine.generate(prompt_token_ids=[3, 4, 5, 6], sampling=sp)
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        np.testing.assert_allclose([x[t] for t in sorted(x)], [y[t] for t in sorted(y)], atol=1e-6)
