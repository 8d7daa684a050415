"""``INFERSCALE_GEMM`` (inferscale_jax/xla_options.py): each choice's compiler options reach every
step executable's compile (on first use and in the warm-up), the engine's tokens do not depend on
the choice (on the CPU the GPU options are accepted and ignored), and a bad value is one clear error
naming the variable."""

import jax
import pytest

from inferscale_jax import SamplingParams
from inferscale_jax.xla_options import GEMM_CHOICES, gemm_choice, step_compiler_options
from tests.support.tiny_engine import make_engine


def generate(prompts):
    e = make_engine(pages=64)
    sp = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    return [o.token_ids for o in e.generate_batch([dict(prompt_token_ids=p, sampling=sp) for p in prompts])]


@pytest.mark.parametrize("value, want", [("", None), ("default", None),
                                         ("exhaustive", {"xla_gpu_exhaustive_tiling_search": True}),
                                         (" cublas ", {"xla_gpu_enable_triton_gemm": False})])
def test_each_choice_names_its_options(monkeypatch, value, want):
    monkeypatch.setenv("INFERSCALE_GEMM", value)
    assert step_compiler_options() == want


def test_a_bad_choice_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("INFERSCALE_GEMM", "fastest")
    with pytest.raises(ValueError) as e:
        gemm_choice()
    msg = str(e.value)
    assert "INFERSCALE_GEMM='fastest'" in msg and all(c in msg for c in GEMM_CHOICES), msg


def test_the_steps_compile_with_the_choice_and_give_the_same_tokens(monkeypatch):
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40))]
    monkeypatch.delenv("INFERSCALE_GEMM", raising=False)
    want = generate(prompts)
    seen = []
    real = jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kw):
        seen.append(compiler_options)
        return real(self, compiler_options=compiler_options, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    monkeypatch.setenv("INFERSCALE_GEMM", "cublas")
    assert generate(prompts) == want
    opts = {"xla_gpu_enable_triton_gemm": False}
    assert opts in seen  # the steps compiled on first use took the option
    seen.clear()  # the warm-up's compiles (on a pool) take it too, every step's
    e = make_engine(pages=64)
    e.warmup()
    steps = len(e.runner.executables)
    assert steps >= 2 and sum(o == opts for o in seen) == steps, (steps, seen)
