"""SamplingParams range checks, request keys, and penalties (inferscale_jax/sampling.py).

Penalties are checked against a plain numpy implementation of the OpenAI / vLLM formulas, and
end to end against HF transformers' ``RepetitionPenaltyLogitsProcessor`` on the HF torch model
of the same tiny weights (greedy, so the tokens must be equal)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support.hf_tiny import build_hf_model
from inferscale_jax import Engine, EngineConfig, SamplingParams
from inferscale_jax.runner import StepRow
from inferscale_jax.sampling import apply_penalties, request_key, sample_tokens
from models import DenseKVCache, forward
from tests.support.tiny_engine import CFG, make_engine

V = CFG.vocab_size  # 97

# (field, bad value, vocab size given to validate or None)
BAD = [
    ("top_k", 2**31, None), ("top_k", V + 1, V), ("top_k", True, None), ("top_k", -2, None), ("top_k", 2.0, None),
    ("max_tokens", 2**31, None), ("max_tokens", True, None), ("max_tokens", 0, None), ("max_tokens", 3.0, None),
    ("seed", -1, None), ("seed", 2**63, None), ("seed", True, None), ("seed", 1.5, None),
    ("temperature", math.nan, None), ("temperature", math.inf, None), ("temperature", -math.inf, None),
    ("temperature", 100.5, None), ("temperature", True, None), ("temperature", "1", None),
    ("top_p", math.nan, None), ("top_p", math.inf, None), ("top_p", 0.0, None), ("top_p", True, None),
    ("stop_token_ids", [2**31], None), ("stop_token_ids", [True], None), ("stop_token_ids", [V], V),
    ("stop_token_ids", [-1], None), ("stop_token_ids", list(range(257)), None), ("stop_token_ids", "ab", None),
    ("logprobs", 21, None), ("logprobs", True, None), ("logprobs", -1, None),
    ("ignore_eos", 1, None), ("stop", ["x" * 257], None), ("stop", ["ok", ""], None), ("stop", ["a"] * 17, None),
    ("presence_penalty", math.nan, None), ("presence_penalty", 2.5, None), ("presence_penalty", -2.01, None),
    ("frequency_penalty", math.inf, None), ("frequency_penalty", True, None),
    ("repetition_penalty", 0.0, None), ("repetition_penalty", 2.1, None), ("repetition_penalty", math.nan, None),
    ("repetition_penalty", -1.0, None), ("min_p", -0.1, None), ("min_p", math.nan, None), ("min_tokens", -1, None),
]


@pytest.mark.parametrize("field,value,vocab", BAD, ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD])
def test_bad_value_raises_naming_the_field(field, value, vocab):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        if vocab is None:
            SamplingParams(**{field: value})
        else:
            SamplingParams(**{field: value}).validate(vocab)


def test_bad_value_set_after_construction_is_caught_by_validate():
    sp = SamplingParams()
    sp.top_k = 2**31  # a mutable dataclass: Engine.submit validates again
    with pytest.raises(ValueError, match=r"top_k=2147483648.*\[0, 2147483647\]"):
        sp.validate()


def test_boundary_values_pass():
    SamplingParams(top_k=2**31 - 1, max_tokens=2**31 - 1, seed=2**63 - 1, temperature=100, top_p=1e-30,
                   stop_token_ids=[2**31 - 1] * 256, logprobs=20, presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=2)
    SamplingParams(top_k=V, stop_token_ids=[V - 1], seed=0, repetition_penalty=1e-6).validate(V)


def test_boundaries_run_through_a_real_engine_step():
    engine = make_engine()
    sp = SamplingParams(max_tokens=4, temperature=1.0, top_k=V, top_p=1e-30, seed=2**63 - 1, stop_token_ids=[V - 1],
                        logprobs=20, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=2.0,
                        repetition_penalty=2.0)
    out = engine.generate(prompt_token_ids=[3, 4, 5], sampling=sp)
    assert 1 <= len(out.token_ids) <= 4 and out.finish_reason in ("length", "stop")
    with pytest.raises(ValueError, match="top_k"):  # the engine checks against its vocab
        engine.submit(prompt_token_ids=[3], sampling=SamplingParams(top_k=V + 1))
    with pytest.raises(ValueError, match="max_tokens"):  # valid, but past the model's context
        engine.submit(prompt_token_ids=[3], sampling=SamplingParams(max_tokens=2**31 - 1))
    again = engine.generate(prompt_token_ids=[3, 4, 5], sampling=sp)  # nothing left broken
    assert again.token_ids == out.token_ids


def test_runner_packing_clamps_top_k():
    """Defense in depth: a row whose top_k does not fit int32 is clamped to the vocab, not an
    OverflowError that would fail every row of the step."""
    engine = make_engine()
    pages = engine.pool.allocate(1)
    key = request_key(7)
    big = engine.runner.step([StepRow([3, 4], 0, pages, temperature=1.0, top_k=2**40, key=key)])
    full = engine.runner.step([StepRow([3, 4], 0, pages, temperature=1.0, top_k=V, key=key)])
    assert big.tokens.tolist() == full.tokens.tolist()


# -- request keys ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 5, 2**31 - 1, 2**31 + 5, 2**32 - 1])
def test_request_key_is_prngkey_for_32_bit_seeds(seed):
    np.testing.assert_array_equal(request_key(seed), np.asarray(jax.random.PRNGKey(seed)))


@pytest.mark.parametrize("seed", [2**32, 2**40 + 7, 2**63 - 1])
def test_request_key_keeps_the_high_bits(seed):
    key = request_key(seed)
    assert key.dtype == np.uint32 and key.shape == (2,)
    with jax.enable_x64(True):  # PRNGKey sees all 64 bits only with x64 on
        np.testing.assert_array_equal(key, np.asarray(jax.random.PRNGKey(seed)))
    assert not np.array_equal(key, request_key(seed % 2**32))  # PRNGKey with x64 off: equal


def test_request_key_without_seed_is_fresh_entropy():
    keys = {tuple(request_key(None).tolist()) for _ in range(8)}
    assert len(keys) == 8


# -- penalties -------------------------------------------------------------------------------

def numpy_penalties(logits, gen, prompt, presence, frequency, repetition):
    """OpenAI presence/frequency over generated tokens, vLLM/HF repetition over prompt + generated."""
    out = logits.astype(np.float64).copy()
    for i in range(out.shape[0]):
        counts = np.bincount(np.asarray(gen[i], np.int64), minlength=out.shape[1])
        seen = counts > 0
        seen[np.asarray(prompt[i], np.int64)] = True
        row = out[i]
        row[seen] = np.where(row[seen] > 0, row[seen] / repetition[i], row[seen] * repetition[i])
        out[i] = row - frequency[i] * counts - presence[i] * (counts > 0)
    return out


def padded(lists, width):
    arr = np.full((len(lists), width), -1, np.int32)
    for i, x in enumerate(lists):
        arr[i, :len(x)] = x
    return arr


def test_apply_penalties_matches_numpy():
    rng = np.random.default_rng(0)
    b, v = 6, 50
    logits = rng.normal(0, 3, (b, v)).astype(np.float32)
    gen = [rng.integers(0, 12, rng.integers(0, 20)).tolist() for _ in range(b)]  # repeats
    prompt = [rng.integers(0, v, rng.integers(0, 10)).tolist() for _ in range(b)]
    params = np.stack([rng.uniform(-2, 2, b), rng.uniform(-2, 2, b), rng.uniform(0.2, 2, b)], 1).astype(np.float32)
    params[0] = (0, 0, 1)  # a row without penalties
    got = apply_penalties(logits, padded(gen, 32), padded(prompt, 16), params)
    want = numpy_penalties(logits, gen, prompt, *params.T)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[0], logits[0])


def test_sample_tokens_penalties_change_the_choice_not_the_logprobs():
    rng = np.random.default_rng(1)
    b, v = 4, 40
    logits = rng.normal(0, 2, (b, v)).astype(np.float32)
    best = logits.argmax(-1)
    gen = [[int(best[i])] * 3 for i in range(b)]  # each row already produced its argmax 3 times
    params = np.array([[0, 0, 1], [2, 0, 1], [0, 2, 1], [0, 0, 2]], np.float32)
    zeros = lambda n: np.zeros(n, np.float32)  # noqa: E731
    args = (logits, zeros(b), np.zeros(b, np.int32), np.ones(b, np.float32), np.zeros((b, 2), np.uint32),
            np.zeros(b, np.int32))
    plain = sample_tokens(*args, num_logprobs=5)
    pen = sample_tokens(*args, num_logprobs=5, penalties=(padded(gen, 16), padded([[]] * b, 0), params))
    want = numpy_penalties(logits, gen, [[]] * b, *params.T).argmax(-1)
    assert np.asarray(pen[0]).tolist() == want.tolist()
    assert np.asarray(pen[0])[0] == best[0] and (np.asarray(pen[0])[1:] != best[1:]).any()
    for a, c in zip(plain[2:], pen[2:]):  # the top log-probs: the raw distribution's (bit-equal on the
        # CPU; on a GPU the penalty variant fuses log_softmax differently: fp32 rounding, 2.4e-7 seen)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=1e-6)
    lp = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(np.asarray(pen[1]), lp[np.arange(b), np.asarray(pen[0])], atol=1e-6)


def test_neutral_penalties_are_bit_identical():
    """Rows with presence/frequency 0 and repetition 1 in the penalty variant sample exactly as
    the common path (sampled, not just greedy)."""
    rng = np.random.default_rng(2)
    b, v = 8, 60
    logits = rng.normal(0, 2, (b, v)).astype(np.float32)
    keys = np.stack([request_key(i) for i in range(b)])
    args = (logits, np.full(b, 0.9, np.float32), np.zeros(b, np.int32), np.full(b, 0.95, np.float32), keys,
            np.arange(b, dtype=np.int32))
    params = np.tile(np.array([[0, 0, 1]], np.float32), (b, 1))
    gen = padded([rng.integers(0, v, 9).tolist() for _ in range(b)], 16)
    plain = sample_tokens(*args)
    neutral = sample_tokens(*args, penalties=(gen, gen, params))
    for a, c in zip(plain, neutral):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def _requests():
    return [
        dict(prompt_token_ids=[5, 6, 7, 8, 9, 5, 6], sampling=SamplingParams(
            max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=0.7)),
        dict(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
        dict(prompt_token_ids=[9, 6, 7], sampling=SamplingParams(
            max_tokens=10, temperature=0.8, seed=3, ignore_eos=True, presence_penalty=1.5)),
        dict(prompt_token_ids=[9, 6, 7, 1], sampling=SamplingParams(
            max_tokens=10, temperature=0.0, ignore_eos=True, frequency_penalty=-1.5)),
    ]


def test_penalties_same_tokens_with_and_without_overlapped_decode():
    """Overlapped decode feeds each row the previous step's token on the device, one token ahead
    of the host's out_ids: the counts must include it, or the two orders would differ."""
    outs = {}
    for overlap in (True, False):
        engine = make_engine(overlap_decode=overlap)
        outs[overlap] = [o.token_ids for o in engine.generate_batch(_requests())]
    assert outs[True] == outs[False]
    # a negative frequency penalty rewards repeats: greedy then repeats a generated token
    assert len(set(outs[True][3])) < len(outs[True][3])


def test_penalties_match_a_host_loop_on_the_model_logits():
    """Greedy with presence/frequency/repetition equals a loop that recomputes the model's raw
    logits (``models.forward`` over a dense cache) and applies ``numpy_penalties``."""
    engine = make_engine()
    prompt = [5, 6, 7, 8, 9, 5, 6]
    pres, freq, rep = 0.4, 0.9, 1.6
    ids = list(prompt)
    for _ in range(8):
        n = len(ids)
        cache = DenseKVCache.create(CFG, 1, n, jnp.float32)
        logits, _ = forward(engine.params, CFG, jnp.asarray([ids], jnp.int32),
                            jnp.arange(n, dtype=jnp.int32)[None], cache)
        pen = numpy_penalties(np.asarray(logits[:, -1]), [ids[len(prompt):]], [prompt], [pres], [freq], [rep])
        ids.append(int(np.argmax(pen[0])))
    ours = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, presence_penalty=pres, frequency_penalty=freq,
        repetition_penalty=rep))
    assert ours.token_ids == ids[len(prompt):]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama_rep"))
    hf = build_hf_model("llama", d)
    engine = Engine.from_pretrained(d, EngineConfig(dtype="float32", page_size=8, hbm_pages=64, prefill_chunk=16))
    return hf, engine


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf(hf_llama, penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    hf, engine = hf_llama
    prompt = [5, 17, 33, 17, 101, 5, 9, 240]
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(16):
            scores = proc(ids, hf(ids).logits[:, -1].float())
            ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], 1)
    want = ids[0, len(prompt):].tolist()
    out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=penalty))
    assert out.token_ids == want
    plain = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True))
    assert plain.token_ids != want  # the penalty changed this greedy run


def test_penalty_id_widths_are_a_short_ladder():
    """Varied prompt and output lengths share a few compiled penalty variants."""
    from inferscale_jax.runner import penalty_width

    widths = {penalty_width(n) for n in range(0, 20000)}
    assert widths == {16, 64, 256, 1024, 4096, 16384, 65536}
    assert all(penalty_width(n) >= n for n in (0, 1, 16, 17, 64, 65, 5000, 19999))
