"""Stop strings on the real default tokenizer: text cut before the first stop, finish 'stop'."""

from inferscale_jax import Engine, EngineConfig, SamplingParams


def test_stop_string_cuts_the_text(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSCALE_CACHE", str(tmp_path))
    e = Engine.from_pretrained(None, EngineConfig(dtype="float32", hbm_pages=256))
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = e.generate("Q: How long is the warranty? A:", sampling=greedy)
    assert len(full.text) > 30
    stop = full.text[20:24]  # a string that first appears at or before character 20
    first = full.text.find(stop)
    out = e.generate("Q: How long is the warranty? A:",
                     sampling=SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                             stop=["never-produced-zz", stop]))
    assert out.finish_reason == "stop"
    assert out.text == full.text[:first]
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < 40
