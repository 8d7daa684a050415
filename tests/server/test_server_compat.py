"""What OpenAI and vLLM clients send, over HTTP against the real server: batched prompts, prompt
log-probs (echo + logprobs, max_tokens 0; vLLM's prompt_logprobs), continuous usage in streams,
the field policy (ignored fields header, neutral values, unsupported ones), several model names,
vLLM's sampling extras and chat-template controls; each checked against the in-process engine."""

import httpx
import pytest

from inferscale_jax import Engine, EngineConfig, SamplingParams, default_model_dir
from tests.support.server_util import ENGINE_KW, Server, cache_dir, sse_events, stream_text

C, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS = ["The warranty lasts", "Returns are accepted within", "Shipping is paid by"]
MSGS = [{"role": "user", "content": "How long is the warranty?"}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return cache_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache):
    srv = Server(tmp_path_factory.mktemp("compat"), cache, "--served-model-name", "tiny", "inferscale")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref(cache, server):
    engine = Engine.from_pretrained(default_model_dir(cache), EngineConfig(**ENGINE_KW))
    server.wait_ready()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def http(server, ref):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def greedy(ref, prompt, n=6, **kw):
    return ref.generate(prompt=prompt, sampling=SamplingParams(max_tokens=n, temperature=0.0, **kw))


def test_models_by_name(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "inferscale"]
    assert http.get("/v1/models/inferscale").json()["id"] == "inferscale"
    r = http.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post(C, json={"model": "inferscale", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"  # responses carry the first name


@pytest.mark.parametrize("as_ids", [False, True])
def test_batched_prompts(http, ref, as_ids):
    prompts = [ref.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS] if as_ids else PROMPTS
    body = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2}
    r = http.post(C, json=body).json()
    want = [ref.generate(**({"prompt_token_ids": p} if as_ids else {"prompt": p}),
                         sampling=SamplingParams(max_tokens=5, temperature=0.0)) for p in prompts]
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert [c["text"] for c in r["choices"]] == [w.text for w in want for _ in range(2)]
    assert r["usage"]["prompt_tokens"] == sum(w.metrics.prompt_tokens for w in want)
    assert r["usage"]["completion_tokens"] == 2 * sum(w.metrics.generated_tokens for w in want)
    with http.stream("POST", C, json={**body, "stream": True}) as resp:
        events = sse_events(list(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    texts = {}
    for ev in events[:-1]:
        for ch in ev["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert [texts[i] for i in range(6)] == [c["text"] for c in r["choices"]]


def test_echo_logprobs_score_the_prompt(http, ref):
    """lm-eval's log-likelihood request: echo + logprobs, max_tokens 0 or 1 (several prompts)."""
    ids = [ref.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    for max_tokens in (0, 1):
        r = http.post(C, json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
                               "temperature": 0})
        assert r.status_code == 200, r.text
        for p, choice in zip(ids, r.json()["choices"]):
            score = ref.prompt_logprobs(prompt_token_ids=p, num_logprobs=1)
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(p) + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing before it
            want = [e[t] for t, e in zip(p[1:], score.logprobs[1:])]
            assert lp["token_logprobs"][1:len(p)] == pytest.approx(want, abs=1e-4)
            for top, entry in zip(lp["top_logprobs"][1:len(p)], score.logprobs[1:]):
                assert max(top.values()) == pytest.approx(max(entry.values()), abs=1e-4)
            assert choice["text"].startswith(ref.tokenizer.decode(p, skip_special_tokens=True))
            if max_tokens:  # the generated token's log-prob follows the prompt's
                gen = ref.generate(prompt_token_ids=p, sampling=SamplingParams(max_tokens=1, temperature=0.0,
                                                                               logprobs=1))
                assert lp["token_logprobs"][-1] == pytest.approx(gen.logprobs[0][gen.token_ids[0]], abs=1e-4)
            assert lp["text_offset"] == sorted(lp["text_offset"])


def test_vllm_prompt_logprobs_and_streamed_echo(http, ref):
    r = http.post(C, json={"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    score = ref.prompt_logprobs(prompt=PROMPTS[0], num_logprobs=2)
    assert plp[0] is None and len(plp) == len(score.token_ids)
    for tid, entry, want, rank in zip(score.token_ids[1:], plp[1:], score.logprobs[1:], score.ranks[1:]):
        assert entry[str(tid)]["logprob"] == pytest.approx(want[tid], abs=1e-4)
        assert entry[str(tid)]["rank"] == rank and len(entry) >= 2
    body = {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 0, "stream": True}
    with http.stream("POST", C, json=body) as resp:
        events = sse_events(list(resp.iter_lines()))
    first = events[0]["choices"][0]
    assert first["text"] == PROMPTS[1] and first["logprobs"]["token_logprobs"][0] is None
    assert stream_text(events) == PROMPTS[1] + greedy(ref, PROMPTS[1], 4).text


def test_continuous_usage_stats(http, ref):
    body = {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", C, json=body) as resp:
        events = sse_events(list(resp.iter_lines()))
    assert events.pop() == "[DONE]"
    want = greedy(ref, PROMPTS[2], 6, ignore_eos=True)
    with_choices = [e for e in events if e["choices"]]
    assert all("usage" in e for e in with_choices)
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert {e["usage"]["prompt_tokens"] for e in with_choices} == {want.metrics.prompt_tokens}
    assert events[-1]["usage"]["completion_tokens"] == 6 and not events[-1]["choices"]


def test_field_policy(http):
    body = {"prompt": "hi", "max_tokens": 2, "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
            "prompt_cache_key": "x", "safety_identifier": "u1", "user": "me", "guided_decoding_backend": "xgrammar",
            "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    r = http.post(C, json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-inferscale-ignored-fields"].split(",") == sorted(
        ["store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "user",
         "guided_decoding_backend"])
    r = http.post(C, json={"prompt": "hi", "max_tokens": 2})
    assert "x-inferscale-ignored-fields" not in r.headers
    for field, value in (("chat_template", "{{ x }}"), ("reasoning_effort", "low")):
        r = http.post(CHAT, json={"messages": MSGS, field: value})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and "unsupported field" in err["message"]
    r = http.post(C, json={"prompt": "hi", "max_tokenz": 2})
    assert r.status_code == 400 and "unknown or unsupported field 'max_tokenz'" in r.json()["error"]["message"]


def test_sampling_extras_over_http(http, ref):
    prompt = PROMPTS[0]
    base = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    forced = http.post(C, json={**base, "logit_bias": {"65": 100}, "logprobs": 0}).json()["choices"][0]
    assert forced["logprobs"]["tokens"] == [ref.tokenizer.decode([65])] * 5
    for extra in ({"top_k": -1, "min_p": 0.0}, {"min_tokens": 3}, {"bad_words": ["the"]},
                  {"skip_special_tokens": False, "spaces_between_special_tokens": False},
                  {"truncate_prompt_tokens": 3}):
        kw = {k: v for k, v in extra.items() if k != "top_k"}
        want = greedy(ref, prompt, 5, ignore_eos=True, **kw)
        r = http.post(C, json={**base, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text, (extra, r.text)
    hot = {"prompt": prompt, "max_tokens": 6, "temperature": 1.5, "min_p": 1.0, "seed": 3, "ignore_eos": True}
    assert http.post(C, json=hot).json()["choices"][0]["text"] == greedy(ref, prompt, 6, ignore_eos=True).text
    text = greedy(ref, prompt, 8, ignore_eos=True).text
    stop = text[2:4]
    r = http.post(C, json={**base, "max_tokens": 8, "stop": [stop], "include_stop_str_in_output": True}).json()
    assert r["choices"][0]["text"] == text[:text.find(stop) + len(stop)]


def test_chat_template_controls(http, ref):
    tok = ref.tokenizer
    for extra, kwargs in (({"add_generation_prompt": False}, dict(add_generation_prompt=False)),
                          ({"chat_template_kwargs": {"unused_variable": 1}}, dict(add_generation_prompt=True))):
        text = tok.apply_chat_template(MSGS, tokenize=False, **kwargs)
        ids = tok.encode(text, add_special_tokens=False)
        want = ref.generate(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=4, temperature=0.0))
        r = http.post(CHAT, json={"messages": MSGS, "max_tokens": 4, "temperature": 0, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text, r.text
    msgs = MSGS + [{"role": "assistant", "content": "It lasts"}]
    text = tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    want = ref.generate(prompt_token_ids=tok.encode(text, add_special_tokens=False),
                        sampling=SamplingParams(max_tokens=4, temperature=0.0))
    r = http.post(CHAT, json={"messages": msgs, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
                              "continue_final_message": True})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text, r.text


def test_broken_chat_template_refused_at_startup(ref):
    """create_app runs check_template before serving: a template that cannot render is refused
    with the fix named; a working one passes."""
    from serving.chat import check_template

    with pytest.raises(ValueError, match="--chat-template"):
        check_template(ref.tokenizer, "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}")
    check_template(ref.tokenizer, "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    check_template(ref.tokenizer, None)  # the model's own
