"""Compiled step executables kept on disk by the engine's own key, so a warm start skips tracing.

JAX's persistent compilation cache (``compile_cache.py``) saves XLA's compile, but a process still
traces and lowers each step bucket to find its cache entry: about a third of a second per bucket
for an 8B model, ~30 s for the ~90 buckets ``Engine.warmup`` compiles on a GPU.  This store keeps
each step's *compiled executable* (``jax.experimental.serialize_executable``) under a name derived
from what determines it without tracing:

- the bucket (``StepKey``), the penalty / sampler variant and the matmul precision;
- a fingerprint of everything else the program depends on: the source of the packages that build
  it (``inferscale_jax``, ``models``, ``pallas_kernels``), the jax / jaxlib versions, ``XLA_FLAGS``,
  the kernels' environment switches (``pallas_kernels.common.switches``)
  and every jax option (``jax.config.values``: the PRNG, the partitioner, x64, ...), the backend and its
  devices, the model config, and the tree, shapes, dtypes and shardings of the weights and the KV
  cache.

Each executable loads for the devices the engine's steps run on (``execution_devices``: its one device, or its
tensor-parallel mesh's, in the mesh's order), not for every device of the host, and an entry's argument trees are
pickled with their devices by id (a tensor-parallel KV cache keeps its mesh in its tree).

So a warm start loads each executable (``load``) instead of tracing it; any change to the code,
the model or the devices names a new folder, and a stale executable is never found.  Each entry is
checked when saved: the payload is loaded back once, and one that cannot be (an executable the CPU
backend loaded from JAX's cache serializes to a payload that names a missing function) is not
kept.  Every failure here only costs the time the store would have saved: ``load`` returns None,
``save`` logs and keeps nothing.  The folder sits beside JAX's cache (``<cache>/inferscale-
executables/<fingerprint>/``), one file per bucket, written atomically.

Measured on one H200: at first (run AI) loading an 8B step from the store took ~0.7 s against
~0.4 s for tracing it and loading it from JAX's cache, one at a time; its entries now load on the
warm-up's compile pool, and run AM's warm ``serve`` start (bench/NOTES.md) took 16.5 s of warm-up
from the store against 42.9 s from JAX's cache alone.  So engines on a GPU keep a store
(``exe_store_wanted``; ``INFERSCALE_EXE_STORE=0`` turns it off, ``=1`` on elsewhere).

A warm start also loads them early (``Preload``): the folder is named only once the weights are
placed, but the folder the last start with the same ``start_key`` (code, model, checkpoint files,
engine config) used is almost surely this one's, so its entries load on threads while the weights
load, and the warm-up finds them loaded; a wrong guess is dropped when the real fingerprint is
known.

Loading an executable runs code from the file (``pickle``): the folder must be as trusted as the
engine's own installation, as JAX's cache folder already is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import threading

import jax
from jax.experimental import serialize_executable

from pallas_kernels.common import switches as kernel_switches

from inferscale_jax.xla_options import step_compiler_options

log = logging.getLogger("inferscale.exe_store")
SOURCE_PACKAGES = ("inferscale_jax", "models", "pallas_kernels")


def exe_store_wanted(platform: str) -> bool:
    """Whether an engine on ``platform`` keeps a store: on GPUs unless ``INFERSCALE_EXE_STORE=0``,
    elsewhere only with ``INFERSCALE_EXE_STORE=1``.

    On the H200 (jax 0.11.2; bench/NOTES.md, run AM) a warm ``serve`` start's warm-up of 92 buckets
    took 16.5 s from the store (its entries loading on the compile pool) against 42.9 s tracing
    each step into JAX's cache: /health 200 after 51.6 s against 78.9 s.  On the CPU an executable
    the backend loaded from JAX's cache does not serialize; TPUs have not been measured."""
    env = os.environ.get("INFERSCALE_EXE_STORE", "")
    if env in ("0", "1"):
        return env == "1"
    return platform in ("gpu", "cuda", "rocm")


def source_digest() -> str:
    """sha256 over the ``.py`` files of the packages that build the step (path and bytes)."""
    import importlib

    h = hashlib.sha256()
    for name in SOURCE_PACKAGES:
        root = os.path.dirname(importlib.import_module(name).__file__)
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as fh:
                        h.update(fh.read())
    return h.hexdigest()


def _avals(tree) -> list[str]:
    return [f"{x.shape}|{x.dtype}|{getattr(x, 'sharding', None)}" for x in jax.tree_util.tree_leaves(tree)]


def _program_parts(cfg, devices) -> dict[str, str]:
    """What a step depends on besides its bucket and its arrays: code, versions, options, model,
    devices."""
    import jaxlib

    # every jax option (PRNG implementation, partitioner, x64, matmul precision ... can change the
    # program; the few that name folders or log settings cost only a spurious miss)
    flags = [os.environ.get("XLA_FLAGS", ""), sorted((k, repr(v)) for k, v in jax.config.values.items()),
             sorted(kernel_switches().items()),  # (e.g. INFERSCALE_SLOT_PREFETCH: pallas_kernels/common.py)
             sorted((step_compiler_options() or {}).items())]  # (INFERSCALE_GEMM: xla_options.py)
    return dict(source=source_digest(), versions=f"{jax.__version__} {jaxlib.__version__}", flags=repr(flags),
                model=repr(cfg), devices=repr([(d.platform, d.device_kind, d.id, d.process_index) for d in devices]),
                platform=str(getattr(devices[0].client, "platform_version", "")))


def fingerprint_parts(params, cache, cfg, devices) -> dict[str, str]:
    """The parts of ``fingerprint``, by name (a tool can say which one differs between two starts:
    bench/tools/exe_store_check.py)."""
    return dict(_program_parts(cfg, devices), tree=repr(jax.tree_util.tree_structure((params, cache))),
                params="\n".join(_avals(params)), cache="\n".join(_avals(cache)))


def fingerprint(params, cache, cfg, devices) -> str:
    """What a step executable depends on besides its bucket (module docstring)."""
    parts = fingerprint_parts(params, cache, cfg, devices)
    return hashlib.sha256("\n".join(parts.values()).encode()).hexdigest()[:32]


KEEP_FOLDERS = 4  # fingerprint folders kept: the one in use and the most recently used others


class ExecutableStore:
    """One engine's folder of compiled steps (module docstring).  Opening it marks it used (its
    mtime) and removes all but the ``keep`` most recently used fingerprint folders beside it: each
    code, model or pool change names a new folder (an 8B model's ~90 steps each), and the store is
    on by default on GPUs, so old ones must not pile up.  A folder another engine still uses may go
    with them; that engine's later loads miss and its steps compile again."""

    def __init__(self, cache_dir: str, fp: str, keep: int = KEEP_FOLDERS, preload: "Preload | None" = None,
                 devices=None):
        """``preload``: this start's early loads (``Preload``), used if they come from ``fp``'s folder;
        ``devices``: the ones the engine's steps run on (``execution_devices``; None: all of the backend's)."""
        root = os.path.join(cache_dir, "inferscale-executables")
        self.devices = devices
        self.folder = os.path.join(root, fp)
        self.loads = self.saves = self.failures = self.preloaded = 0
        self._preloaded = preload.take(fp) if preload is not None else {}
        self._lock = threading.Lock()
        try:
            os.makedirs(self.folder, exist_ok=True)
            os.utime(self.folder)
            _prune(root, keep, self.folder)
        except OSError as err:  # the store is an optimization: a folder that cannot be kept costs compiles
            log.warning("executable store %s: %s", root, err)

    def _path(self, key: tuple) -> str:
        return os.path.join(self.folder, hashlib.sha256(repr(key).encode()).hexdigest()[:40] + ".exe")

    def load(self, key: tuple):
        """The compiled executable saved for ``key``, or None (none saved, or it did not load)."""
        path = self._path(key)
        early = self._preloaded.pop(path, None)
        try:
            early = early if early is not None and not early.cancelled() else None
            saved_key, exe = early.result() if early is not None else _read(path, self.devices)
            if saved_key != repr(key):
                return None
        except FileNotFoundError:
            return None
        except Exception as err:  # noqa: BLE001 - a bad entry costs a compile, never a request
            log.warning("compiled step %s did not load from %s (%s: %s); compiling it", key[0], path,
                        type(err).__name__, err)
            with self._lock:
                self.failures += 1
            return None
        with self._lock:
            self.loads += 1
            self.preloaded += early is not None
        return exe

    def drop_early(self) -> None:
        """Let go of the early loads no step asked for (after the warm-up: a later first use loads
        its entry from disk, and the loaded executables are not held for the engine's life)."""
        for fut in self._preloaded.values():
            fut.cancel()
        self._preloaded = {}

    def save(self, key: tuple, exe) -> bool:
        """Keep ``exe`` (a ``jax.stages.Compiled``) for ``key`` if it serializes and loads back."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(exe)
            _deserialize(payload, in_tree, out_tree, self.devices)  # the check
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    _Pickler(f).dump((repr(key), payload, in_tree, out_tree))
                os.replace(tmp, self._path(key))
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as err:  # noqa: BLE001 - the store is an optimization
            log.debug("compiled step %s not stored (%s: %s)", key[0], type(err).__name__, err)
            with self._lock:
                self.failures += 1
            return False
        with self._lock:
            self.saves += 1
        return True


def _read(path: str, devices=None) -> tuple:
    """(the key saved in the entry at ``path``, its executable, loaded for ``devices``)."""
    with open(path, "rb") as f:
        saved_key, payload, in_tree, out_tree = _Unpickler(f).load()
    return saved_key, _deserialize(payload, in_tree, out_tree, devices)


class _Pickler(pickle.Pickler):
    """Pickles an entry whose argument trees name devices (a tensor-parallel KV cache keeps its mesh in its
    tree): each device by its id, as the executable's own payload does."""

    def __init__(self, f):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)

    def persistent_id(self, obj):
        return ("device", obj.id) if isinstance(obj, jax.Device) else None


class _Unpickler(pickle.Unpickler):
    def __init__(self, f):
        super().__init__(f)
        self.devices = {d.id: d for d in jax.devices()}

    def persistent_load(self, pid):
        if pid[0] == "device":
            return self.devices[pid[1]]
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def _deserialize(payload, in_tree, out_tree, devices):
    """An executable loaded for the devices it runs on, in its device order (``devices``: the engine's one
    device, or its mesh's devices; None: every device of the backend, which is only right when the engine
    uses them all - on a host with more, a step loaded so failed at its first call, and a tensor-parallel
    one aborted the process in XLA)."""
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                     execution_devices=None if devices is None else list(devices))


def execution_devices(mesh, device) -> list:
    """The devices a step runs on, in the order its executable assigns them: the mesh's (tensor
    parallelism), else the one device."""
    return list(mesh.devices.flat) if mesh is not None else [device]


def start_key(model_dir: str, cfg, config, devices) -> str:
    """What a start knows before its weights load, hashed: the code, versions and options, the
    model config, the devices, the checkpoint's files (names, sizes, mtimes) and the engine config.
    A start with the same key builds the same arrays (the pool's size follows the weights' bytes:
    ``Engine._auto_pages``), so the store folder the last one used is almost surely this one's.
    Raises ``OSError`` when the folder cannot be listed (the caller then loads nothing early)."""
    files = []
    for name in sorted(os.listdir(model_dir)):
        if name.endswith((".safetensors", ".json")):
            st = os.stat(os.path.join(model_dir, name))
            files.append((name, st.st_size, st.st_mtime_ns))
    parts = dict(_program_parts(cfg, devices), files=repr(files), config=repr(config))
    return hashlib.sha256("\n".join(parts.values()).encode()).hexdigest()[:32]


HINTS_KEPT = 32  # start keys remembered (one small file each)
PRELOAD_MAX = 512  # entries one start loads early, at most (the oldest first: a cold warm-up saved those)


class Preload:
    """A warm start's store entries, loading on threads while the weights load.

    The store's folder is named by the weights' and the KV pool's shapes, known only once the
    weights are placed (``fingerprint``), so until now every entry loaded after the load (6.5 s of
    run AM's 16.5 s warm-up, bench/NOTES.md).  A start knows its ``start_key`` before the load; the
    folder the last start with that key used (a hint file per key beside the store) is loaded at
    once, every entry on a pool of ``workers`` threads.  Once the engine knows its fingerprint it
    ``take``s them: the same folder gives the loads to the store (``ExecutableStore.load`` waits
    for an entry still loading), another cancels them (what is already loading is dropped) and
    the hint names the new folder.  A wrong guess costs only the threads' work.  ``cancel`` stops
    them (a start that failed before it knew its fingerprint)."""

    def __init__(self, cache_dir: str, key: str, workers: int | None = None, devices=None):
        """``devices``: the ones the engine's steps will run on (``execution_devices``); the entries load for them."""
        self.hints = os.path.join(cache_dir, "inferscale-executable-starts")
        self.key, self.fp, self.futures, self._pool = key, None, {}, None
        try:
            with open(os.path.join(self.hints, key)) as f:
                self.fp = f.read().strip() or None
            folder = os.path.join(cache_dir, "inferscale-executables", self.fp or "")
            entries = sorted((os.stat(e.path).st_mtime_ns, e.path) for e in os.scandir(folder)
                             if e.name.endswith(".exe"))[:PRELOAD_MAX]
        except OSError:  # (no hint, or its folder is gone: nothing to load early)
            return
        if entries:
            import concurrent.futures

            self._pool = concurrent.futures.ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1),
                                                               thread_name_prefix="inferscale-preload")
            self.futures = {path: self._pool.submit(_read, path, devices) for _, path in entries}
            self._pool.shutdown(wait=False)  # (its threads end when the queue is done or cancelled)
            log.info("executable store: loading %d steps of %s early", len(entries), folder)

    def cancel(self) -> None:
        """Stop the early loads not yet begun (the ones loading finish and are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.futures = {}

    def take(self, fp: str) -> dict:
        """The early loads (path -> future of ``_read``) if they come from folder ``fp``, else {}
        (and the rest cancelled); the hint names ``fp`` from now on."""
        self._remember(fp)  # (rewritten each start: the hints kept are the most recently used)
        if fp != self.fp:
            if self.futures:
                log.info("executable store: this start's steps are in another folder than the last's; "
                         "the %d early loads were dropped", len(self.futures))
            self.cancel()
            return {}
        return dict(self.futures)

    def _remember(self, fp: str) -> None:
        try:
            os.makedirs(self.hints, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.hints, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(fp)
            os.replace(tmp, os.path.join(self.hints, self.key))
            hints = sorted(((e.stat().st_mtime, e.path) for e in os.scandir(self.hints)), reverse=True)
            for _, path in hints[HINTS_KEPT:]:
                os.unlink(path)
        except OSError as err:  # (a hint is an optimization)
            log.debug("executable store hint not written: %s", err)


def _prune(root: str, keep: int, current: str) -> None:
    """Remove the fingerprint folders under ``root`` but ``current`` and the most recently used
    others, ``keep`` in all."""
    import shutil

    folders = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if path != current and os.path.isdir(path):
            try:
                folders.append((os.stat(path).st_mtime, path))
            except FileNotFoundError:  # (removed meanwhile by another engine)
                continue
    for _, path in sorted(folders, reverse=True)[max(0, keep - 1):]:
        shutil.rmtree(path, ignore_errors=True)
        log.info("executable store: removed %s (older than the %d most recently used)", path, keep)
