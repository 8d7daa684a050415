"""Section c of ``bench/engine/engine_bench.py``: the HF transformers peer, same model shape, same GPU, same run.

``LlamaForCausalLM`` (bf16, ``attn_implementation="sdpa"``, the implementation actually used is read
back from the model and reported), random init on the GPU.  Per L: a full prefill of L + 64 tokens,
and prefix reuse two ways: eager (the L-token ``DynamicCache`` computed once; per request the 64-token
question appended, then ``cache.crop(-64)``: cropping removes only the question, nothing of the prefix
is copied - a deep copy of the cache, as an earlier version did, costs ~0.5 GB of traffic at 4k and is
not what a serving system does) and HF's fastest documented path (a ``StaticCache`` holding the
prefix, the question compiled with ``torch.compile(mode="reduce-overhead")``, i.e. CUDA graphs,
written over the previous question's slots).  All with ``use_cache=True, logits_to_keep=1`` (what
``generate`` does for its first token) and an argmax of the last logits, timed with
``torch.cuda.synchronize``.  Also one eager decode step over the 4k cache.  The model is freed after.
If torch cannot run in the benchmark's process, the section reruns this file as a child process
(``python bench/engine/hf_peer.py --worker SPEC``; JAX holds only its memory fraction).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

from common import EngineBench, ms, shape  # noqa: E402  (bench/lib/common.py)
from report import MD, log, section, table  # noqa: E402  (bench/lib/report.py)

Q = 64  # question tokens

def run_hf(spec: dict) -> dict:
    """The HF transformers peer; returns {"full": {L: s}, "reuse": {L: s}, "decode": s, ...}."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sh, quick = spec["shape"], spec["quick"]
    dev = torch.device("cpu" if quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    config = LlamaConfig(vocab_size=sh["vocab"], hidden_size=sh["hidden"], intermediate_size=sh["inter"],
                         num_hidden_layers=sh["layers"], num_attention_heads=sh["heads"],
                         num_key_value_heads=sh["kv"], head_dim=sh["head_dim"], rms_norm_eps=sh["eps"],
                         rope_parameters={"rope_type": "default", "rope_theta": sh["theta"]},
                         max_position_embeddings=sh["max_pos"], tie_word_embeddings=False,
                         attn_implementation="sdpa")
    config.dtype = dtype
    t0 = time.time()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    p = next(model.parameters())
    res = {"device": str(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"),
           "torch": torch.__version__, "dtype": str(p.dtype), "full": {}, "reuse": {}, "decode": None}
    import transformers
    res["transformers"] = transformers.__version__
    print(f"  HF model on {p.device} {p.dtype}, {sum(x.numel() for x in model.parameters()) / 1e9:.3f} B "
          f"params, built in {time.time() - t0:.1f} s", flush=True)
    gen = torch.Generator(device="cpu").manual_seed(99)

    def ids(n):
        return torch.randint(0, sh["vocab"], (1, n), generator=gen).to(dev)

    def first_token(out):
        return out.logits[:, -1].argmax(-1)

    # transformers renamed past_key_values -> cache (5.2x); the GPU machine has 5.17
    import inspect
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def out_cache(out):
        c = getattr(out, "cache", None) if cache_kw == "cache" else None
        return c if c is not None else out.past_key_values

    def timeit(fn, make_inputs, warm, reps):
        for _ in range(warm):
            fn(*make_inputs())
        sync()
        times = []
        for _ in range(reps):
            inp = make_inputs()
            sync()
            t0 = time.perf_counter()
            fn(*inp)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    reps = spec["reps"]
    with torch.inference_mode():
        def full(x):
            first_token(model(x, use_cache=True, logits_to_keep=1)).item()

        for L in spec["Ls"]:
            res["full"][L] = timeit(full, lambda: (ids(L + Q),), 1, reps if L < 16384 else max(3, reps - 2))
            print(f"  HF full prefill {L}+{Q}: {res['full'][L] * 1e3:.2f} ms", flush=True)
        for L in spec["Ls"]:
            ctx = out_cache(model(ids(L), use_cache=True, logits_to_keep=1))

            def reuse(q, ctx=ctx):
                # the question's K/V are appended to the prefix cache, then cropped off again: nothing
                # of the prefix is copied (a deepcopy of the whole cache, as before, costs ~0.5 GB at 4k)
                first_token(model(q, **{cache_kw: ctx}, use_cache=True, logits_to_keep=1)).item()
                ctx.crop(-q.shape[1])  # (negative: remove that many tokens; every transformers 5.x)

            res["reuse"][L] = timeit(reuse, lambda: (ids(Q),), 2, 2 * reps)
            print(f"  HF prefix reuse {L} + {Q} (eager, crop): {res['reuse'][L] * 1e3:.2f} ms", flush=True)
            if L == spec["dec_L"]:
                # one decode step, batch 1, over the L + Q cache (the cache grows by one per step)
                c = copy.deepcopy(ctx)
                tok = first_token(model(ids(Q), **{cache_kw: c}, use_cache=True, logits_to_keep=1))
                times = []
                for i in range(4 + 2 * reps):
                    sync()
                    t0 = time.perf_counter()
                    tok = first_token(model(tok[:, None], **{cache_kw: c}, use_cache=True,
                                            logits_to_keep=1))
                    tok.item()
                    times.append(time.perf_counter() - t0)
                res["decode"] = statistics.median(times[4:])
                print(f"  HF decode step over {L}+{Q}: {res['decode'] * 1e3:.2f} ms", flush=True)
                del c
            del ctx
        res["attn_implementation"] = model.config._attn_implementation
        try:
            res["reuse_static"] = hf_static_reuse(model, dev, ids, first_token, timeit, cache_kw, spec)
        except Exception as e:  # noqa: BLE001 - reported, the eager rows stand
            print(f"  HF StaticCache + torch.compile path failed: {type(e).__name__}: {e}", flush=True)
            res["reuse_static_error"] = f"{type(e).__name__}: {e}"[:300]
    model = None  # noqa: F841 - freed before the next section
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def rewind_static_cache(cache, n: int) -> None:
    """Make a ``StaticCache`` write its next tokens at position ``n``: transformers 5.2x layers count
    their own length (``cumulative_length``, a tensor updated in place, so CUDA graphs keep it);
    older ones take the write positions from ``cache_position`` alone (nothing to do)."""
    import torch

    for layer in getattr(cache, "layers", []):
        if torch.is_tensor(getattr(layer, "cumulative_length", None)):
            layer.cumulative_length.fill_(n)


def hf_static_reuse(model, dev, ids, first_token, timeit, cache_kw, spec) -> dict:
    """HF's fastest documented path for a reused prefix: a ``StaticCache`` holding the prefix's K/V
    and the Q-token question compiled with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs on
    a GPU).  Reuse writes the question at positions L..L+Q-1 of the same static cache, overwriting
    the previous question there (the prefix slots are never touched, slots past the question are
    masked by ``cache_position``): no copy at all.  {L: seconds}."""
    import torch
    from transformers import StaticCache

    forward = torch.compile(model.forward, mode="reduce-overhead")
    out = {}
    for L in spec["Ls"]:
        cache = StaticCache(config=model.config, max_cache_len=L + Q)
        model(ids(L), **{cache_kw: cache}, cache_position=torch.arange(L, device=dev), use_cache=True,
              logits_to_keep=1)
        pos = torch.arange(L, L + Q, device=dev)

        def reuse(q, cache=cache, pos=pos, L=L):
            rewind_static_cache(cache, L)
            first_token(forward(q, **{cache_kw: cache}, cache_position=pos, use_cache=True,
                                logits_to_keep=1)).item()

        out[L] = timeit(reuse, lambda: (ids(Q),), 3, 2 * spec["reps"])
        print(f"  HF prefix reuse {L} + {Q} (StaticCache + torch.compile reduce-overhead): "
              f"{out[L] * 1e3:.2f} ms", flush=True)
        del cache
    return out


def hf_reuse(hf: dict, L: int):
    """HF's best prefix reuse at L: the faster of eager and StaticCache + torch.compile."""
    static = hf.get("reuse_static") or {}
    got = [x for x in (hf.get("reuse", {}).get(L), static.get(L), static.get(str(L))) if x]
    return min(got) if got else None


def hf_spec(b: EngineBench, no_child: bool = False) -> dict:
    s = b.s
    return dict(shape=shape(b.quick), quick=b.quick, Ls=s["Ls"], dec_L=s["dec_L"], reps=s["hf_reps"],
                no_child=no_child)


@section
def hf_peer(b: EngineBench, no_child: bool = False):
    spec = hf_spec(b, no_child)
    try:
        res = run_hf(spec)
        res["where"] = "same process"
    except Exception:  # noqa: BLE001
        log(traceback.format_exc())
        if b.quick or no_child:
            raise
        log("  HF in this process failed: retrying in a child process")
        gc.collect()
        try:
            import torch
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
        log(p.stdout[-4000:] + p.stderr[-4000:])
        line = next((l for l in reversed(p.stdout.splitlines()) if l.startswith("HF_RESULT ")), None)
        if line is None:
            raise RuntimeError(f"HF child process failed (rc {p.returncode})")
        res = json.loads(line[len("HF_RESULT "):])
        res["full"] = {int(k): v for k, v in res["full"].items()}
        res["reuse"] = {int(k): v for k, v in res["reuse"].items()}
        res["where"] = "child process"
    b.R["hf"] = res
    static = res.get("reuse_static") or {}
    rows = [[L, ms(res["full"].get(L)), ms(res["reuse"].get(L)), ms(static.get(L) or static.get(str(L)))]
            for L in spec["Ls"]]
    table(f"c. HF transformers {res.get('transformers')} / torch {res.get('torch')} "
          f"({res['dtype']}, attention {res.get('attn_implementation', 'sdpa')}, {res['where']}; logits_to_keep=1)",
          ["L", f"full prefill L+{Q} ms", f"prefix reuse, eager (+{Q}, crop) ms",
           f"prefix reuse, StaticCache + torch.compile (+{Q}) ms"], rows)
    if res.get("reuse_static_error"):
        MD.extend([f"StaticCache + torch.compile path failed: {res['reuse_static_error']}", ""])
    if res.get("decode"):
        log(f"  HF decode step over {spec['dec_L']}+{Q}: {ms(res['decode'])} ms")
        MD.extend([f"HF decode step, batch 1, over {spec['dec_L']}+{Q} tokens: {ms(res['decode'])} ms", ""])


# ---------------------------------------------------------------- (d) decode


if __name__ == "__main__":  # the child process of hf_peer: the peer alone, its result as the last line
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("usage: python bench/engine/hf_peer.py --worker SPEC_JSON (run by bench/engine/engine_bench.py section c)")
    print("HF_RESULT " + json.dumps(run_hf(json.loads(sys.argv[2]))), flush=True)
