"""The executable store (``exe_store.py``): compiled steps kept by bucket, so a warm start skips tracing.

- a second process with the same store loads every warmed bucket without tracing one, and
  generates the same tokens as the process that compiled them;
- a corrupt entry, or one saved under another key, is not used: the step compiles and the
  output is unchanged;
- the fingerprint changes with the model, the weights' dtype, a jax option and the source; the store is on
  on GPUs unless ``INFERSCALE_EXE_STORE=0``, elsewhere only with ``=1``.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from inferscale_jax import SamplingParams
from inferscale_jax import exe_store
from inferscale_jax.exe_store import ExecutableStore, exe_store_wanted, fingerprint
from tests.support.tiny_engine import CFG, make_engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import json, sys, jax
from inferscale_jax import Engine, EngineConfig, SamplingParams
from models import init_params
from tests.support.tiny_engine import CFG
traced = []
from inferscale_jax.runner import ModelRunner
real = ModelRunner._lower
ModelRunner._lower = lambda self, *a, **k: (traced.append(1), real(self, *a, **k))[1]
e = Engine(init_params(CFG, jax.random.PRNGKey(0), scale=0.5), CFG, None,
           EngineConfig(dtype="float32", page_size=8, hbm_pages=64, prefill_chunk=16,
                        compilation_cache_dir=sys.argv[1]))
e.warmup()
outs = e.generate_batch([dict(prompt_token_ids=[5, 6, 7, 8, 9, 10, 11, 12, 13], sampling=SamplingParams(
    max_tokens=10, temperature=0.0, ignore_eos=True)), dict(prompt_token_ids=[3] * 20, sampling=SamplingParams(
    max_tokens=6, temperature=0.8, seed=3))])
st = e.runner.exe_store
print(json.dumps(dict(loads=st.loads, saves=st.saves, failures=st.failures, traced=len(traced),
                      buckets=len(e.runner.executables), tokens=[o.token_ids for o in outs])))
"""


def child(cache_dir: str, script: str = CHILD) -> dict:
    """Run ``script`` in a new process with the store on and ``cache_dir`` as its cache; its last line's JSON."""
    env = dict(os.environ, INFERSCALE_EXE_STORE="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", script, cache_dir], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_every_step_without_tracing_and_outputs_match(tmp_path):
    cold = child(str(tmp_path))
    assert cold["loads"] == 0 and cold["saves"] == cold["buckets"] >= 3 and cold["failures"] == 0
    assert cold["traced"] == cold["buckets"]
    warm = child(str(tmp_path))
    assert warm["loads"] == warm["buckets"] == cold["buckets"] and warm["saves"] == 0
    assert warm["traced"] == 0  # (nothing traced: every step came from the store)
    assert warm["tokens"] == cold["tokens"]


def compile_one(e):
    """Run one greedy request on ``e`` (its steps compile or load on first use)."""
    return e.generate_batch([dict(prompt_token_ids=[4, 5, 6, 7], sampling=SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True))])[0].token_ids


def with_store(tmp_path):
    e = make_engine(pages=64)
    r = e.runner
    r.exe_store = ExecutableStore(str(tmp_path), fingerprint(r.params, r.cache, r.cfg, [r.device]))
    return e


def test_a_corrupt_entry_is_not_used(tmp_path, caplog):
    first = with_store(tmp_path)
    want = compile_one(first)
    store = first.runner.exe_store
    assert store.saves >= 1
    for name in os.listdir(store.folder):
        with open(os.path.join(store.folder, name), "wb") as f:
            f.write(b"not a pickle")
    second = with_store(tmp_path)
    assert compile_one(second) == want
    assert second.runner.exe_store.loads == 0 and second.runner.exe_store.failures >= 1
    assert "did not load" in caplog.text


def test_an_entry_saved_under_another_key_is_not_returned(tmp_path):
    e = with_store(tmp_path)
    compile_one(e)
    store = e.runner.exe_store
    key = next(iter(e.runner.executables))
    other = (key[0], ("another variant",), key[2])
    os.replace(store._path(key), store._path(other))  # a file whose name says `other`, holding `key`
    assert store.load(other) is None and store.load(key) is None
    assert store.save(key, e.runner.executables[key]) and store.load(key) is not None


def test_the_fingerprint_follows_the_model_dtype_jax_options_and_source(monkeypatch):
    e = make_engine(pages=64)
    r = e.runner
    base = fingerprint(r.params, r.cache, r.cfg, [r.device])
    assert fingerprint(r.params, r.cache, r.cfg, [r.device]) == base
    import dataclasses
    assert fingerprint(r.params, r.cache, dataclasses.replace(CFG, rms_norm_eps=1e-6), [r.device]) != base
    half = jax.tree_util.tree_map(lambda x: x.astype("bfloat16"), r.params)
    assert fingerprint(half, r.cache, r.cfg, [r.device]) != base
    was = jax.config.jax_threefry_partitionable  # a jax option that changes the sampler's program
    jax.config.update("jax_threefry_partitionable", not was)
    try:
        assert fingerprint(r.params, r.cache, r.cfg, [r.device]) != base
    finally:
        jax.config.update("jax_threefry_partitionable", was)
    monkeypatch.setenv("INFERSCALE_SLOT_PREFETCH", "0")  # a kernel switch: another program, another entry
    assert fingerprint(r.params, r.cache, r.cfg, [r.device]) != base
    monkeypatch.delenv("INFERSCALE_SLOT_PREFETCH")
    assert fingerprint(r.params, r.cache, r.cfg, [r.device]) == base
    monkeypatch.setenv("INFERSCALE_GEMM", "exhaustive")  # the steps' compiler options (xla_options.py)
    assert fingerprint(r.params, r.cache, r.cfg, [r.device]) != base
    monkeypatch.setenv("INFERSCALE_GEMM", "default")  # the same options as unset: the same entry
    assert fingerprint(r.params, r.cache, r.cfg, [r.device]) == base
    monkeypatch.delenv("INFERSCALE_GEMM")
    monkeypatch.setattr(exe_store, "source_digest", lambda: "edited")
    assert fingerprint(r.params, r.cache, r.cfg, [r.device]) != base


@pytest.mark.parametrize("env, platform, want", [("", "cpu", False), ("", "gpu", True), ("0", "gpu", False),
                                                 ("1", "cpu", True), ("1", "gpu", True), ("yes", "cpu", False),
                                                 ("", "tpu", False), ("yes", "gpu", True)])
def test_the_switch(monkeypatch, env, platform, want):
    monkeypatch.setenv("INFERSCALE_EXE_STORE", env)
    assert exe_store_wanted(platform) is want


def test_opening_a_store_keeps_only_the_most_recently_used_folders(tmp_path):
    root = tmp_path / "inferscale-executables"
    for i, name in enumerate(["a", "b", "c", "d", "e"]):
        (root / name).mkdir(parents=True)
        (root / name / "x.exe").write_bytes(b"1")
        os.utime(root / name, (1000 + i, 1000 + i))  # a oldest, e newest
    (root / "stray.txt").write_text("not a folder")
    store = ExecutableStore(str(tmp_path), "new", keep=3)
    assert os.path.isdir(store.folder)
    assert sorted(os.listdir(root)) == ["d", "e", "new", "stray.txt"]  # new + the two most recent others
    ExecutableStore(str(tmp_path), "d", keep=3)  # reopening d marks it the most recently used; three stay
    assert sorted(os.listdir(root)) == ["d", "e", "new", "stray.txt"]
    ExecutableStore(str(tmp_path), "f", keep=2)
    assert sorted(os.listdir(root)) == ["d", "f", "stray.txt"]


START_CHILD = r"""
import json, sys
from inferscale_jax import Engine, EngineConfig, SamplingParams
e = Engine.from_pretrained(None, EngineConfig(hbm_pages=128, compilation_cache_dir=sys.argv[1], max_batch=4))
e.warmup()
out = e.generate(prompt_token_ids=[5, 6, 7, 8, 9], sampling=SamplingParams(max_tokens=6, temperature=0.0,
                                                                         ignore_eos=True))
st = e.runner.exe_store
print(json.dumps(dict(loads=st.loads, preloaded=st.preloaded, saves=st.saves, buckets=len(e.runner.executables),
                      tokens=out.token_ids)))
"""


def test_a_warm_start_loads_its_steps_beside_the_weights(tmp_path):
    """``from_pretrained`` twice with one cache: the second start's steps all come from the store, every
    one of them loaded while the weights loaded (the start key, and so the hint, is the same in a
    new process), and the tokens are the first start's."""
    cold = child(str(tmp_path), START_CHILD)
    assert cold["saves"] == cold["buckets"] >= 3 and cold["preloaded"] == 0
    warm = child(str(tmp_path), START_CHILD)
    assert warm["loads"] == warm["preloaded"] == cold["buckets"] and warm["saves"] == 0
    assert warm["tokens"] == cold["tokens"]


def test_early_loads_are_used_only_for_their_own_folder(tmp_path):
    # (in this process the CPU backend's executables may come from JAX's cache, and such a one does
    # not run once loaded back: the loads are checked here, the runs by the two starts above)
    first = with_store(tmp_path)
    compile_one(first)
    fp = first.runner.exe_store.folder.rsplit(os.sep, 1)[1]
    assert exe_store.Preload(str(tmp_path), "k").take(fp) == {}  # no hint yet: nothing early; now one
    early = exe_store.Preload(str(tmp_path), "k")
    assert early.fp == fp and len(early.futures) == len(os.listdir(first.runner.exe_store.folder)) >= 1
    second = make_engine(pages=64)
    r = second.runner
    r.exe_store = ExecutableStore(str(tmp_path), fingerprint(r.params, r.cache, r.cfg, [r.device]), preload=early)
    keys = [k for k in first.runner.executables if os.path.exists(first.runner.exe_store._path(k))]
    assert keys and all(r.exe_store.load(k) is not None for k in keys)
    assert r.exe_store.preloaded == r.exe_store.loads == len(keys) == len(early.futures)
    # a start whose fingerprint is another's: its early loads are dropped and the hint follows it
    wrong = exe_store.Preload(str(tmp_path), "k")
    assert len(wrong.futures) == len(keys)
    store = ExecutableStore(str(tmp_path), "another-folder", preload=wrong)
    assert wrong.futures == {} and store._preloaded == {}  # (cancelled and let go)
    assert store.load(keys[0]) is None and store.preloaded == 0  # (that folder holds nothing)
    assert exe_store.Preload(str(tmp_path), "k").fp == "another-folder"
    assert exe_store.Preload(str(tmp_path), "never-started").futures == {}


def test_the_start_key_follows_the_checkpoint_files_and_the_engine_config(tmp_path):
    from inferscale_jax import EngineConfig
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    devices = jax.devices()[:1]
    base = exe_store.start_key(str(tmp_path), CFG, EngineConfig(), devices)
    assert exe_store.start_key(str(tmp_path), CFG, EngineConfig(), devices) == base
    assert exe_store.start_key(str(tmp_path), CFG, EngineConfig(hbm_pages=64), devices) != base
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)
    assert exe_store.start_key(str(tmp_path), CFG, EngineConfig(), devices) != base


def test_a_start_that_fails_stops_its_early_loads(tmp_path, monkeypatch):
    """A load that raises (here: the weights) cancels the early loads not yet begun; the error is the load's."""
    import inferscale_jax.engine as engine_mod
    from inferscale_jax import Engine, EngineConfig

    seen = []
    real = exe_store.Preload

    class Watched(real):
        def cancel(self):
            seen.append(self.key)
            super().cancel()
    monkeypatch.setenv("INFERSCALE_EXE_STORE", "1")
    monkeypatch.setattr(engine_mod, "Preload", Watched)

    def broken(*a, **k):
        raise OSError("a shard that cannot be read")
    monkeypatch.setattr(engine_mod, "load_params", broken)
    with pytest.raises(OSError, match="cannot be read"):
        Engine.from_pretrained(None, EngineConfig(hbm_pages=64, compilation_cache_dir=str(tmp_path)))
    assert len(seen) == 1


MULTI_CHILD = CHILD.replace("compilation_cache_dir=sys.argv[1]))",
                            "compilation_cache_dir=sys.argv[1], tensor_parallel=int(sys.argv[2])))")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_store_on_a_host_with_more_devices_than_the_engine_uses(tmp_path, tp):
    """Four devices, an engine on one (tp 1) or two (tp 2): the store loads each executable for the devices it
    runs on (not every device of the host: steps failed at their first call, and tp 2's save aborted the process
    in XLA), and a warm start's outputs equal the cold one's."""
    env = dict(os.environ, INFERSCALE_EXE_STORE="1", PYTHONPATH=ROOT,
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", MULTI_CHILD, str(tmp_path), str(tp)], env=env,
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["saves"] == cold["buckets"] >= 3 and cold["failures"] == 0, cold
    assert warm["loads"] == warm["buckets"] and warm["traced"] == 0 and warm["failures"] == 0, warm
    assert warm["tokens"] == cold["tokens"]
