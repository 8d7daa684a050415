"""Structured outputs in the engine (structured.py): every output under a JSON schema, regex or
choice list matches it, greedy and sampled; the mask is applied on the device row by row, so a
constrained row and an unconstrained row in one batch each equal their solo runs; a grammar
that does not compile fails its request alone, naming the problem."""

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from inferscale_jax import Engine, EngineConfig, SamplingParams, StructuredOutputs
from inferscale_jax.sampling import apply_token_mask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "code", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    e = Engine.from_pretrained(None, EngineConfig(dtype="float32", page_size=8, hbm_pages=256, prefill_chunk=32))
    yield e
    e.close()


def run(engine, prompt="Describe the user:", **kw):
    return engine.generate(prompt, sampling=SamplingParams(**kw))


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2), (0.8, 3)])
def test_json_schema_output_parses_and_validates(engine, temperature, seed):
    out = run(engine, max_tokens=400, temperature=temperature, seed=seed,
              structured_outputs=StructuredOutputs(json=SCHEMA))
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_schema_as_text_json_object_regex_and_choice(engine):
    out = run(engine, max_tokens=400, temperature=1.0, seed=4, structured_outputs=StructuredOutputs(
        json=json.dumps(SCHEMA)))
    jsonschema.validate(json.loads(out.text), SCHEMA)
    out = run(engine, max_tokens=40, temperature=1.0, seed=5, structured_outputs=StructuredOutputs(
        regex=r"[0-9]{3}-[a-z]{2,4}"))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.text), out.text
    choices = ["red", "green", "dark blue"]
    texts = {run(engine, max_tokens=10, temperature=1.0, seed=s,
                 structured_outputs=StructuredOutputs(choice=choices)).text for s in range(6)}
    assert texts <= set(choices), texts
    grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/'
    out = run(engine, max_tokens=10, temperature=1.0, seed=6, structured_outputs=StructuredOutputs(grammar=grammar))
    assert re.fullmatch(r"yes|no|maybe [0-9]{1,3}", out.text), out.text
    gbnf = 'root ::= "x" [0-9] [0-9]'
    out = run(engine, max_tokens=10, temperature=1.0, seed=7, structured_outputs=StructuredOutputs(grammar=gbnf))
    assert re.fullmatch(r"x[0-9][0-9]", out.text), out.text


def test_json_object_is_an_object(engine):
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"],
              "additionalProperties": False}
    out = run(engine, max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputs(json=schema))
    assert json.loads(out.text)["k"] in (1, 2)
    out = run(engine, max_tokens=60, temperature=1.0, seed=3, structured_outputs=StructuredOutputs(json_object=True))
    if out.finish_reason == "stop":  # (an unbounded object may run out of tokens: then it is a prefix)
        assert isinstance(json.loads(out.text), dict)
    assert out.text.startswith("{")


def test_constrained_and_unconstrained_rows_in_one_batch_equal_their_solo_runs(engine):
    """The mask is per row on the device: a batch of mixed rows changes no row's tokens."""
    free = [dict(prompt=p, sampling=SamplingParams(max_tokens=24, temperature=t, seed=s, ignore_eos=True))
            for p, t, s in (("Hello there", 0.0, None), ("Once upon", 1.0, 11), ("The cat", 0.7, 12))]
    tied = [dict(prompt=p, sampling=SamplingParams(max_tokens=120, temperature=t, seed=s,
                                                   structured_outputs=StructuredOutputs(json=SCHEMA)))
            for p, t, s in (("User one:", 0.0, None), ("User two:", 1.0, 13))]
    solo = [engine.generate(**r).token_ids for r in free + tied]
    mixed = engine.generate_batch([free[0], tied[0], free[1], tied[1], free[2]])
    assert [o.token_ids for o in mixed] == [solo[0], solo[3], solo[1], solo[4], solo[2]]
    for o in (mixed[1], mixed[3]):
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_logprobs_stop_strings_n_and_segments_with_a_grammar(engine):
    sp = dict(max_tokens=400, temperature=1.0, seed=21, structured_outputs=StructuredOutputs(json=SCHEMA))
    out = run(engine, logprobs=2, **sp)
    assert len(out.logprobs) == len(out.token_ids)
    assert all(tok in lp for tok, lp in zip(out.token_ids, out.logprobs))  # raw log-probs of the sampled ids
    jsonschema.validate(json.loads(out.text), SCHEMA)
    cut = run(engine, stop=['"age"'], **sp)  # a stop string ends a constrained output like any other
    assert cut.finish_reason == "stop" and '"age"' not in cut.text and out.text.startswith(cut.text)
    # a tenant's context as a segment: the injected request equals the full prefill, constrained
    engine.register_segment("faq-structured", text="Our store opens at nine. Returns take 30 days.")
    seg = engine.generate("Answer as JSON:", segments=["faq-structured"], sampling=SamplingParams(**sp))
    full = engine.generate("Our store opens at nine. Returns take 30 days.Answer as JSON:",
                           sampling=SamplingParams(**sp))
    assert seg.token_ids == full.token_ids
    jsonschema.validate(json.loads(seg.text), SCHEMA)
    # several choices of one prompt, each its own matcher
    outs = engine.generate_batch([dict(prompt="Pick:", sampling=SamplingParams(
        max_tokens=10, temperature=1.0, seed=30 + i, structured_outputs=StructuredOutputs(choice=["x1", "y2"])))
        for i in range(4)])
    assert all(o.text in ("x1", "y2") for o in outs)


@pytest.mark.parametrize("spec,needle", [
    (StructuredOutputs(regex="[a-"), "unclosed character class"),
    (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (StructuredOutputs(grammar="start: foo"), "foo"),
])
def test_a_grammar_that_does_not_compile_fails_its_request_alone(engine, spec, needle):
    ok = dict(prompt="Hi", sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    rid_bad = engine.submit("Hi", sampling=SamplingParams(max_tokens=4, structured_outputs=spec))
    rid_ok = engine.submit(**ok)
    got = {}
    while len(got) < 2:
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o
    assert isinstance(got[rid_bad].error, ValueError) and needle in str(got[rid_bad].error)
    assert got[rid_ok].error is None and len(got[rid_ok].output.token_ids) == 4


def test_invalid_specs_are_refused_at_submit(engine):
    for kw in (dict(), dict(json=SCHEMA, regex="a"), dict(choice=[]), dict(choice=["a", 3]), dict(regex=""),
               dict(json=[1, 2]), dict(json="{not json")):
        with pytest.raises(ValueError, match="structured_outputs"):
            engine.submit("x", sampling=SamplingParams(structured_outputs=StructuredOutputs(**kw)))


def test_cached_grammar_is_ready_at_submit(engine):
    spec = StructuredOutputs(regex="[a-c]{2}")
    run(engine, max_tokens=5, structured_outputs=spec)
    hits = engine.grammars.counters["hits"]
    rid = engine.submit("x", sampling=SamplingParams(max_tokens=5, structured_outputs=StructuredOutputs(
        regex="[a-c]{2}")))
    assert engine.grammars.counters["hits"] == hits + 1
    assert engine.scheduler.requests[rid].status == "waiting"  # no compile: queued at once
    engine.abort(rid)


def test_apply_token_mask_matches_llguidance_numpy_reference():
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(0)
    for vocab in (97, 1024, 1000):
        words = -(-vocab // 32)
        mask = rng.integers(-2**31, 2**31, size=(5, words), dtype=np.int64).astype(np.int32)
        mask[3] = -1  # a row that allows everything
        logits = rng.standard_normal((5, vocab)).astype(np.float32)
        want = logits.copy()
        apply_token_bitmask_inplace(want, mask)
        got = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(mask)))
        np.testing.assert_array_equal(got, want)


def test_objects_with_properties_are_closed_unless_the_schema_says_otherwise(engine):
    """As vLLM's default backend: listed properties only, so a model cannot invent keys forever."""
    from inferscale_jax.structured import closed

    open_ = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    for seed in range(3):
        out = run(engine, max_tokens=40, temperature=1.0, seed=seed, structured_outputs=StructuredOutputs(json=open_))
        assert set(json.loads(out.text)) <= {"a"}, out.text
    nested = {"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {"type": "integer"}}},
                                               "z": {"type": "object", "additionalProperties": True,
                                                     "properties": {"w": {"const": {"k": 1}}}}},
              "$defs": {"d": {"properties": {"q": {}}}}}
    got = closed(nested)
    assert got["additionalProperties"] is False and got["properties"]["x"]["additionalProperties"] is False
    assert got["properties"]["z"]["additionalProperties"] is True  # said explicitly: kept
    assert got["properties"]["z"]["properties"]["w"]["const"] == {"k": 1}  # values are not schemas
    assert got["$defs"]["d"]["additionalProperties"] is False
    assert closed({"type": "object"}) == {"type": "object"}  # no properties listed: any object


def test_fed_constrained_rows_sample_after_their_masks_and_equal_the_unoverlapped_engine(engine):
    """Overlapped decode feeds a constrained row's token on the device and samples that step only
    once the token is applied to the grammar (runner.sample): no step waits for the one before,
    and the tokens equal an engine that settles every step before the next (overlap off)."""
    plain = Engine.from_pretrained(None, EngineConfig(dtype="float32", page_size=8, hbm_pages=256, prefill_chunk=32,
                                                      overlap_decode=False))
    reqs = [dict(prompt=p, sampling=SamplingParams(max_tokens=60, temperature=t, seed=s, structured_outputs=so))
            for p, t, s, so in (("One:", 1.0, 41, StructuredOutputs(json=SCHEMA)), ("Two:", 0.0, None, None),
                                ("Three:", 0.9, 42, StructuredOutputs(regex="[a-z]{4,30}")),
                                ("Four:", 1.0, 43, None))]
    calls = []
    sample = engine.runner.sample
    engine.runner.sample = lambda step: calls.append(len(step.rows)) or sample(step)
    try:
        got = [o.token_ids for o in engine.generate_batch(reqs)]
    finally:
        engine.runner.sample = sample
    want = [o.token_ids for o in plain.generate_batch(reqs)]
    plain.close()
    assert got == want
    assert len(calls) >= 10, calls  # the constrained steps were deferred, not settled


def test_structured_outputs_compile_no_step_of_the_model():
    """A constrained request runs the step executables an unconstrained one compiled: its masks
    are applied by the small sampling executable, never by a variant of the model's step (that
    would compile the whole model again, on the engine thread, stalling every stream)."""
    eng = Engine.from_pretrained(None, EngineConfig(dtype="float32", page_size=8, hbm_pages=256, prefill_chunk=32))
    try:
        prompts = ["Describe the user:", "Two words:", "Name a colour please"]
        free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        eng.generate_batch([dict(prompt=p, sampling=free) for p in prompts])  # this shape's buckets compile
        steps = set(eng.runner.executables)
        compiles = eng.runner.compiles
        so = StructuredOutputs(regex=r"[a-z ]{24}")  # (every row runs to max_tokens, as the free ones)
        tied = SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=so)
        outs = eng.generate_batch([dict(prompt=p, sampling=tied) for p in prompts])
        assert all(re.fullmatch(r"[a-z ]{1,24}", o.text) for o in outs), [o.text for o in outs]
        assert set(eng.runner.executables) == steps and eng.runner.compiles == compiles
        assert any(k[0] == "sample" for k in eng.runner.helpers)  # the masks' sampler
    finally:
        eng.close()
