"""JAX's persistent compilation cache, switched on for every engine (``EngineConfig.compilation_cache``).

JAX keys each compiled executable by its program, shapes, backend and jax/XLA versions and can
keep it on disk (``jax_compilation_cache_dir``); a process that compiles the same step again
loads it instead.  The engine's step buckets are the same from one start to the next, so a
restarted server (or a test process after the first) skips most compile time.  The setting is
process-wide: the first engine sets the folder, and an engine asking for another folder while
one is set keeps the one in use (logged), since JAX cannot switch folders mid-process.

Counters: JAX reports cache hits and misses through ``jax.monitoring`` events; one listener,
registered once per process, counts them for ``stats()`` (``compile_cache_hits`` / ``misses``).
"""

from __future__ import annotations

import logging
import os
import threading

import jax

log = logging.getLogger("inferscale.compile_cache")
# executables faster to compile than this are not worth a disk entry
MIN_COMPILE_SECONDS = 0.2
_counts = {"hits": 0, "misses": 0}
_lock = threading.Lock()
_listening = False

_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}


def _on_event(name: str, **_kw) -> None:
    key = _EVENTS.get(name)
    if key is not None:
        with _lock:
            _counts[key] += 1


def default_dir() -> str:
    from inferscale_jax.default_model import cache_root

    return os.path.join(os.path.abspath(cache_root()), "jax-compile")


def enable(path: str | None) -> str | None:
    """Use ``path`` (None: ``default_dir()``) as JAX's compilation cache; returns the folder in
    use, or None when it cannot be created (a read-only home: the engine runs without a cache)."""
    global _listening
    path = path or default_dir()
    current = jax.config.jax_compilation_cache_dir
    if current and os.path.abspath(current) != path:
        log.info("the JAX compilation cache already uses %s; keeping it (not %s)", current, path)
        path = current
    else:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            log.warning("no compilation cache: cannot create %s (%s); every start compiles its steps "
                        "(set EngineConfig.compilation_cache_dir to a writable folder)", path, err)
            return None
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
    return path


def counts() -> dict[str, int]:
    """Persistent-cache hits and misses of this process so far."""
    with _lock:
        return dict(_counts)
