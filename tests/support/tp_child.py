"""Child process of test_tensor_parallel.py, started with 4 host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``): builds the tiny "tp" HF checkpoint, runs
the same requests on engines of tensor_parallel 1, 2 and 4 and on HF transformers, and prints one
JSON object with what the parent checks.

    python tests/support/tp_child.py WORKDIR
"""

import json
import os
import sys

# Run as a file: the repository root goes on sys.path (tests.support, inferscale_jax, models).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tests.support.hf_tiny import build_hf_model  # noqa: E402

from inferscale_jax import Engine, EngineConfig, SamplingParams  # noqa: E402
from models import ModelConfig, load_params  # noqa: E402

N_OUT = 6


def hf_greedy(model, tokens):
    """HF's greedy continuation and the log-prob of each chosen token (full prefill)."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=N_OUT, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    toks = out.sequences[0, len(tokens):].tolist()
    lps = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(out.scores, toks)]
    return toks, lps


def chosen(out):
    return out.token_ids, [out.logprobs[i][t] for i, t in enumerate(out.token_ids)]


def run(params, cfg, tp, seg_a, seg_b, q, work, label="", **kw):
    sp = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True, logprobs=1)
    conf = dict(dtype="float32", page_size=8, hbm_pages=64, prefill_chunk=16, tensor_parallel=tp, **kw)
    e = Engine(params, cfg, None, EngineConfig(**conf))
    e.debug_checks = True
    e.register_segment("a", token_ids=seg_a)
    e.register_segment("b", token_ids=seg_b)
    r = {}
    r["chain"] = chosen(e.generate(prompt_token_ids=q, segments=["a", "b"], sampling=sp))  # chain node computed
    again = e.generate(prompt_token_ids=q, segments=["a", "b"], sampling=sp)  # chain node and prefix cache hit
    r["again"], r["again_cached"] = chosen(again), again.metrics.cached_tokens
    r["plain"] = chosen(e.generate(prompt_token_ids=seg_a + seg_b + q, sampling=sp))  # prefix-cache hit on a
    r["compose"] = chosen(e.generate(prompt_token_ids=q, segments=["a", "b"], sampling=sp, mode="compose"))
    # host tier: demote segment a, then a request promotes it back into the sharded pool
    e.tiers.demote(e.store.resolve("a", "default"), "host")
    r["tier_before"] = e.segment_tier("a")
    r["promoted"] = chosen(e.generate(prompt_token_ids=q, segments=["a"], sampling=sp))
    r["tier_after"] = e.segment_tier("a")
    w = e.runner.params["layers"][0]
    r["shards"] = {name: [list(s.data.shape) for s in w[name].addressable_shards]
                   for name in ("wqkv", "wo", "w_gate_up", "w_down")}
    r["shards"]["embed"] = [list(s.data.shape) for s in e.runner.params["embed"].addressable_shards]
    r["shards"]["pages"] = [list(s.data.shape) for s in e.runner.cache.k[0].addressable_shards]
    r["mesh"] = e.stats()["mesh"]["tensor_parallel"]
    r["decode_loops"] = e.stats()["decode_loops"]
    if tp > 1:  # a snapshot of this TP degree restored onto another one re-shards
        snap = os.path.join(work, f"snap{label}{tp}-{kw.get('attention_impl', 'ref')}")
        s = Engine(params, cfg, None, EngineConfig(**dict(conf, snapshot_dir=snap)))
        s.register_segment("a", token_ids=seg_a)
        s.save_snapshot()
        s.close()
        other = 2 if tp == 4 else 4
        t = Engine(params, cfg, None, EngineConfig(**dict(conf, snapshot_dir=snap, tensor_parallel=other)))
        out = t.generate(prompt_token_ids=q, segments=["a"], sampling=sp)
        r["restored"], r["restored_cached"] = chosen(out), out.metrics.cached_tokens
        t.close()
    return r


def main(work):
    model = build_hf_model("tp", os.path.join(work, "hf"))
    cfg = ModelConfig.from_pretrained(os.path.join(work, "hf"))
    params = load_params(os.path.join(work, "hf"), cfg, np.float32)
    rng = np.random.default_rng(0)
    seg_a = rng.integers(3, 256, 21).tolist()
    seg_b = rng.integers(3, 256, 13).tolist()
    q = rng.integers(3, 256, 7).tolist()
    res = {"devices": len(jax.devices()),
           "hf": {"chain": hf_greedy(model, seg_a + seg_b + q), "a_q": hf_greedy(model, seg_a + q)}}
    for tp in (1, 2, 4):
        res[str(tp)] = run(params, cfg, tp, seg_a, seg_b, q, work)
    # 2 kv heads on 4 devices: each kv head replicated twice (sharding.expand_kv)
    model2 = build_hf_model("llama", os.path.join(work, "hf2"))
    cfg2 = ModelConfig.from_pretrained(os.path.join(work, "hf2"))
    params2 = load_params(os.path.join(work, "hf2"), cfg2, np.float32)
    res["hf_rep"] = {"chain": hf_greedy(model2, seg_a + seg_b + q), "a_q": hf_greedy(model2, seg_a + q)}
    for tp in (1, 4):
        res[f"rep{tp}"] = run(params2, cfg2, tp, seg_a, seg_b, q, work, label="rep")
    # sharded loading: each device reads its slices from the files; the same arrays as loading whole
    # and sharding after, for the fused (q/k/v, gate/up), row-parallel, vocab-parallel and replicated
    # weights, and for replicated kv heads
    from inferscale_jax import sharding
    from models import load_params_sharded
    for name, c, p, tp in (("load2", cfg, params, 2), ("load4", cfg, params, 4), ("load_rep4", cfg2, params2, 4)):
        mesh = sharding.make_mesh(tp)
        lcfg, loaded = load_params_sharded(os.path.join(work, "hf" if c is cfg else "hf2"), c, mesh, np.float32)
        _, placed = sharding.shard_params(c, p, mesh)
        leaves = zip(jax.tree_util.tree_leaves_with_path(loaded), jax.tree_util.tree_leaves(placed))
        res[name] = {"fused_shards": lcfg.fused_shards, "kv_heads": lcfg.num_kv_heads, "mismatch": [
            jax.tree_util.keystr(path) for (path, a), b in leaves
            if a.sharding != b.sharding or not np.array_equal(np.asarray(a), np.asarray(b))]}
    # Engine.from_pretrained with tensor_parallel=2 loads sharded (no tokenizer in this folder: ids only)
    e = Engine.from_pretrained(os.path.join(work, "hf"), EngineConfig(dtype="float32", page_size=8, hbm_pages=64,
                                                                      prefill_chunk=16, tensor_parallel=2))
    out = e.generate(prompt_token_ids=seg_a + q, sampling=SamplingParams(max_tokens=N_OUT, temperature=0.0,
                                                                         ignore_eos=True, logprobs=1))
    res["pretrained2"] = chosen(out)
    # random weights generated sharded (benchmarks): init_params' values in the layout of shard_params
    from models import init_params
    mesh = sharding.make_mesh(4)
    _, gen = sharding.init_params_sharded(cfg2, mesh, jax.random.PRNGKey(3), np.float32)
    _, ref = sharding.shard_params(cfg2, init_params(cfg2, jax.random.PRNGKey(3), np.float32), mesh)
    res["init_sharded_mismatch"] = [
        jax.tree_util.keystr(path) for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(gen),
                                                            jax.tree_util.tree_leaves(ref))
        if a.sharding != b.sharding or not np.allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)]
    # compressed KV pages (int8 and a float32 scale per token and head) split over 2 devices
    for tp in (1, 2):
        res[f"int8_{tp}"] = run(params, cfg, tp, seg_a, seg_b, q, work, label="int8", kv_dtype="int8")
    # the Pallas kernels (interpret mode on the CPU) inside shard_map, TP=2
    res["pallas2"] = run(params, cfg, 2, seg_a, seg_b, q, work, attention_impl="pallas")
    # multi-step decode (decode_loop.py) over the sharded pool, the Pallas kernels inside the loop
    res["loop_pallas2"] = run(params, cfg, 2, seg_a, seg_b, q, work, label="loop", attention_impl="pallas",
                              decode_steps=4)
    print("TP_RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
