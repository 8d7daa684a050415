"""Matmul precision benchmark: a float32 engine against HF transformers in true float32.

Usage (from the repository root)::

    python bench/engine/precision.py --out bench/results        # H200: Qwen2 shape, ~2 min
    python bench/engine/precision.py --quick --out /tmp/pq      # tiny model on the CPU, ~1 min

Model: Qwen2 shape (q/k/v biases, GQA 16:2, head_dim 128), hidden 2048, 4 layers, intermediate
5504, vocab 32000 (``--quick``: hidden 64, 2 layers, vocab 512), random weights made with
transformers + torch in float32 (norm weights 1 + 0.1 N(0,1), biases 0.1 N(0,1),
``initializer_range`` 0.05 so the next-token distribution is not flat) and saved as a local
checkpoint, loaded by ``Engine.from_pretrained(dir, EngineConfig(dtype="float32", ...))``.

Request: a 1024-token segment (``register_segment``, then injected) + a 32-token question,
greedy, 64 tokens, ``logprobs=5`` (``--quick``: 64 + 8 tokens, 16 generated).

Reference: the HF torch model on the same weights with TF32 off
(``torch.backends.cuda.matmul.allow_tf32 = False``, cuDNN too): its own greedy run (KV cache),
and one teacher-forced forward over the engine's tokens, which gives the reference log-prob of
every token the engine chose.  Each engine runs with ``matmul_precision`` "default" (TF32 dots
on a GPU) and "highest" (IEEE float32).  Figures per precision:

- first token: the largest |engine - HF| log-prob over the engine's top-5 ids;
- all tokens: the largest |engine - HF| log-prob of the chosen token (teacher-forced);
- greedy: the first position where the engine's tokens differ from HF's own greedy run, and
  HF's top-1 - top-2 logit margin there (a near tie is a legitimate split);
- the floor: the same log-prob errors against the HF model in float64, for the engine and for
  HF float32 itself (float32 rounding alone, with torch's order of operations).

Writes ``precision.md`` and ``precision.png`` (per-token error, when matplotlib is importable)
to ``--out``.  Imports nothing from ``serving/`` (the GPU image has no fastapi).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch (the HF peer)

import argparse  # noqa: E402
import datetime  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
from report import FAILURES, MD, code_version, log, pyplot, section, table, write_md  # noqa: E402  (bench/lib/report.py)

PRECISIONS = ("default", "highest")
R: dict = {}


def shape(quick: bool) -> dict:
    if quick:
        return dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, seg=64, question=8, new=16)
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=2, seg=1024, question=32, new=64)


def build_checkpoint(sh: dict, out_dir: str, device: str):
    """A random Qwen2-shaped float32 checkpoint in ``out_dir``; returns the torch model on ``device``."""
    import torch
    import transformers

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads")
    cfg = transformers.Qwen2Config(**{k: sh[k] for k in keys}, max_position_embeddings=4096, rope_theta=1e6,
                                   rms_norm_eps=1e-6, initializer_range=0.05, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases, as the tests' tiny checkpoints
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return model.to(device)


@section
def hf_reference(model, prompt: list[int], new: int, device: str):
    """HF's own greedy tokens and per-step logits, TF32 off."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    ids, margins, first = [], [], None
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        for i in range(new):
            logits = out.logits[0, -1].float()
            if first is None:
                first = torch.log_softmax(logits, -1).cpu().numpy()
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            tok = int(torch.argmax(logits))
            ids.append(tok)
            out = model(torch.tensor([[tok]], device=device), past_key_values=out.past_key_values, use_cache=True)
    R["hf"] = dict(ids=ids, margins=margins, first_logprobs=first, device=device)
    log(f"HF greedy: {ids[:16]}...; smallest top-2 margin {min(margins):.4f}")


def teacher_forced(model, prompt: list[int], ids: list[int], device: str) -> tuple[np.ndarray, np.ndarray]:
    """HF log-probs after prompt + ids[:i] (TF32 off), in the model's dtype: ([len(ids)] the
    log-prob of each of ``ids``, [V] the whole first distribution)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids[:-1]], device=device)).logits[0, len(prompt) - 1:]
        lp = torch.log_softmax(logits, -1)
        chosen = lp[torch.arange(len(ids), device=device), torch.tensor(ids, device=device)]
        return chosen.double().cpu().numpy(), lp[0].double().cpu().numpy()


@section
def hf_float64_floor(model, prompt: list[int]):
    """HF float32's own log-prob error against float64 on its greedy tokens (the floor)."""
    import copy

    import torch

    R["model64"] = copy.deepcopy(model).to(torch.float64)
    hf = R["hf"]
    lp32, first32 = teacher_forced(model, prompt, hf["ids"], hf["device"])
    lp64, first64 = teacher_forced(R["model64"], prompt, hf["ids"], hf["device"])
    top5 = np.argsort(first32)[-5:]
    R["hf32"] = dict(first_err64=float(np.abs(first32[top5] - first64[top5]).max()), err64=np.abs(lp32 - lp64))
    log(f"HF float32 vs float64: first-token {R['hf32']['first_err64']:.2e}, all tokens max "
        f"{R['hf32']['err64'].max():.2e}")


@section
def engine_run(model_dir: str, model, seg: list[int], question: list[int], new: int, precision: str,
               device: str):
    from inferscale_jax import Engine, EngineConfig, SamplingParams

    config = EngineConfig(dtype="float32", page_size=16, hbm_pages=256, max_batch=8, prefill_chunk=512,
                          matmul_precision=precision)
    t0 = time.perf_counter()
    eng = Engine.from_pretrained(model_dir, config)
    if eng.runner.matmul_precision != config.resolved_matmul_precision:
        # an engine.py that does not hand EngineConfig.matmul_precision to its runner yet
        log(f"engine runner precision {eng.runner.matmul_precision!r}: set to {precision!r} here")
        eng.runner.matmul_precision = config.resolved_matmul_precision
    eng.register_segment("doc", token_ids=seg)
    out = eng.generate(prompt_token_ids=question, segments=["doc"],
                       sampling=SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=5))
    wall = time.perf_counter() - t0
    ids = list(out.token_ids)
    hf = R["hf"]
    first_ids = list(out.logprobs[0])
    first_err = max(abs(out.logprobs[0][t] - float(hf["first_logprobs"][t])) for t in first_ids)
    ref, _ = teacher_forced(model, seg + question, ids, device)
    ours = np.array([out.logprobs[i][t] for i, t in enumerate(ids)])
    err = np.abs(ours - ref)
    div = next((i for i, (a, b) in enumerate(zip(ids, hf["ids"])) if a != b), None)
    R[precision] = dict(ids=ids, first_err=first_err, err=err, div=div, wall=wall)
    if "model64" in R:
        ref64, first64 = teacher_forced(R["model64"], seg + question, ids, device)
        R[precision]["err64"] = np.abs(ours - ref64)
        R[precision]["first_err64"] = max(abs(out.logprobs[0][t] - first64[t]) for t in first_ids)
    log(f"{precision}: first-token max abs(dlogprob) {first_err:.2e}, all tokens max {err.max():.2e}, "
        f"first divergence {div}, {wall:.1f} s")
    eng.close()


def report(sh: dict, args) -> None:
    hf = R.get("hf")
    rows = []
    for p in PRECISIONS:
        r = R.get(p)
        if r is None or hf is None:
            rows.append([p, "failed", "", "", "", ""])
            continue
        div = r["div"]
        rows.append([p, f"{r['first_err']:.2e}", f"{r['err'].max():.2e}", f"{np.median(r['err']):.2e}",
                     f"none ({len(r['ids'])}/{len(r['ids'])} equal)" if div is None else f"token {div}",
                     "" if div is None else f"{hf['margins'][div]:.4f}"])
    table(f"float32 engine vs HF torch float32 (TF32 off), {sh['seg']}-token injected segment + "
          f"{sh['question']}-token question, {sh['new']} greedy tokens",
          ["matmul_precision", "first-token max abs(dlogprob) (top-5)", f"max abs(dlogprob) ({sh['new']} tokens)",
           "median abs(dlogprob)", "greedy vs HF", "HF top-2 margin there"], rows)
    floor = []
    for name, r in [("HF torch float32, TF32 off", R.get("hf32"))] + [(f"engine, {p}", R.get(p)) for p in PRECISIONS]:
        if r is not None and "err64" in r:
            floor.append([name, f"{r['first_err64']:.2e}", f"{r['err64'].max():.2e}", f"{np.median(r['err64']):.2e}"])
    if floor:
        table("The same against HF torch float64 (the float32 rounding floor)",
              ["model", "first-token max abs(dlogprob) (top-5)", f"max abs(dlogprob) ({sh['new']} tokens)",
               "median abs(dlogprob)"], floor)
    plt = pyplot()
    if plt is not None and all(p in R for p in PRECISIONS):
        fig, ax = plt.subplots(figsize=(8, 4))
        for p in PRECISIONS:
            ax.semilogy(np.maximum(R[p]["err"], 1e-9), marker=".", label=f'engine, matmul_precision="{p}"')
        if "hf32" in R:  # HF float32 against float64 on its own tokens: the rounding floor
            ax.semilogy(np.maximum(R["hf32"]["err64"], 1e-9), "k--", label="HF float32 vs HF float64 (floor)")
        ax.set_xlabel("generated token")
        ax.set_ylabel("|log-prob error| of the chosen token")
        ax.set_title(f"float32 engine vs HF float32 ({jax.devices()[0].device_kind})")
        ax.legend()
        fig.tight_layout()
        os.makedirs(args.out, exist_ok=True)
        fig.savefig(os.path.join(args.out, "precision.png"), dpi=120)
        log(f"wrote {os.path.join(args.out, 'precision.png')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="tiny model (CPU)")
    args = ap.parse_args()
    sh = shape(args.quick)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    MD.extend([f"# Matmul precision: float32 engine vs HF float32 ({datetime.date.today()})", "",
               f"`{shlex.join(['python', 'bench/engine/precision.py', *sys.argv[1:]])}` on "
               f"{jax.devices()[0].device_kind} (jax {jax.__version__}, torch {torch.__version__}); "
               f"model: Qwen2 shape {sh}, random float32 weights; code {code_version()}.", ""])
    rng = np.random.default_rng(0)
    seg = rng.integers(3, sh["vocab_size"], sh["seg"]).tolist()
    question = rng.integers(3, sh["vocab_size"], sh["question"]).tolist()
    with tempfile.TemporaryDirectory() as model_dir:
        t0 = time.perf_counter()
        model = build_checkpoint(sh, model_dir, device)
        log(f"checkpoint built and saved in {time.perf_counter() - t0:.1f} s")
        hf_reference(model, seg + question, sh["new"], device)
        if "hf" in R:
            hf_float64_floor(model, seg + question)
        for p in PRECISIONS:
            if "hf" in R:
                engine_run(model_dir, model, seg, question, sh["new"], p, device)
    report(sh, args)
    if FAILURES:
        MD.extend(["## Failures", ""] + [f"- {f}" for f in FAILURES])
    write_md(args.out, "precision.md", MD)
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
