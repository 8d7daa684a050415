"""The persistent compilation cache: a second engine in a new process loads the step executables
the first one compiled (JAX's own cache-hit counter, no timing)."""

import json
import os
import subprocess
import sys

from tests.support import REPO

CHILD = r"""
import json, sys
sys.path.insert(0, {root!r})
from inferscale_jax import EngineConfig, SamplingParams
from tests.support.tiny_engine import make_engine
e = make_engine(compilation_cache_dir={cache!r})
out = e.generate(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=3, temperature=0.0))
s = e.stats()
print(json.dumps(dict(hits=s["compile_cache_hits"], misses=s["compile_cache_misses"], dir=s["compile_cache_dir"],
                      tokens=out.token_ids)))
"""


def _run(tmp_path, cache):
    code = CHILD.format(root=REPO, cache=cache)
    env = {**os.environ, "INFERSCALE_CACHE": str(tmp_path / "home")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_second_process_hits_the_compilation_cache(tmp_path):
    first = _run(tmp_path, "./jit-cache")  # a relative folder, as a user would type it
    assert first["dir"] == str(tmp_path / "jit-cache") and first["misses"] > 0
    assert os.listdir(tmp_path / "jit-cache")
    second = _run(tmp_path, "./jit-cache")
    assert second["hits"] >= first["misses"] - 1 and second["tokens"] == first["tokens"]
    assert second["misses"] < first["misses"]


LOAD_CHILD = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax
import inferscale_jax.engine as engine_module
from inferscale_jax import EngineConfig
from inferscale_jax.engine import Engine
seen = []
real = engine_module.load_params
def spy(*args, **kwargs):
    seen.append(jax.config.jax_compilation_cache_dir)
    return real(*args, **kwargs)
engine_module.load_params = spy
Engine.from_pretrained(None, EngineConfig(compilation_cache_dir={cache!r}))
print(json.dumps(seen))
"""


def test_the_weights_load_with_the_compilation_cache_on(tmp_path):
    """The checkpoint's placing ops compile (on a GPU ~4 s of a start, bench/NOTES.md run AL) inside
    the cache, so a restart loads them: the cache is set before ``load_params`` runs."""
    cache = str(tmp_path / "jit-cache")
    env = {**os.environ, "INFERSCALE_CACHE": str(tmp_path / "home")}
    res = subprocess.run([sys.executable, "-c", LOAD_CHILD.format(root=REPO, cache=cache)], capture_output=True,
                         text=True, env=env, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [cache]
