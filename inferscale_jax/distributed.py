"""Multi-process serving: one engine whose tensor-parallel mesh spans several processes (hosts).

JAX is multi-controller: every process runs the same program, and a jitted step over a mesh that
spans processes runs only when every process calls it, with the same arguments, in the same order.
So the engine runs in lockstep in every process: process 0 (the leader) serves HTTP and drives the
schedule; its ``LockstepEngine`` sends each state-changing call (``submit``, ``step``, ``abort``,
``register_segment``, ``register_segments_batch``, ``delete_segment``, segment versions and
sessions, ``warmup``, ``close``: ``LOCKSTEP_CALLS``) to the
other processes before making it, and they (``follow``) make the same call on their own engine.
The engine is deterministic given its calls (a request without a seed gets one on the leader, so
sampling agrees), so every process reaches the same device steps.  The calls travel as pickled
bytes through ``broadcast.py`` (``multihost_utils.broadcast_one_to_all``: the collectives of the
mesh: NCCL on GPUs, gloo on CPUs), padded to a power-of-two size so few shapes compile.

``initialize`` starts ``jax.distributed`` (coordinator address, process count and id; or the
cluster environment JAX detects when they are None), with gloo as the CPU collectives.

Tiers across processes: each process keeps its own shards of a demoted segment in its pinned host
memory and in its own disk tier (``disk_dir/process-I-of-P``: ``tiers.py`` converts between a
block's global array and this process's part).  Snapshots: one global orbax checkpoint of every
process's shards in the shared ``snapshot_dir`` (``snapshot_processes.py``); the leader decides when
a periodic one is due and makes it a lockstep ``save_snapshot``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import secrets
import time

import jax

from inferscale_jax.broadcast import broadcast_bytes, is_leader
from inferscale_jax.config import EngineConfig
from inferscale_jax.engine import Engine

log = logging.getLogger("inferscale.distributed")

LOCKSTEP_CALLS = ("submit", "step", "abort", "register_segment", "register_segments_batch", "delete_segment",
                  "update_segment", "append_segment", "save_session", "list_sessions", "session_info",
                  "delete_session", "warmup", "save_snapshot", "close")  # (session calls delete expired sessions)
# calls after which the leader checks whether a periodic snapshot is due (it alone decides)
CHANGES = ("register_segment", "register_segments_batch", "delete_segment", "update_segment", "append_segment",
           "save_session", "delete_session")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """``jax.distributed.initialize`` (gloo collectives on CPU backends); call before any JAX work."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw = {k: v for k, v in dict(coordinator_address=coordinator, num_processes=num_processes,
                                process_id=process_id).items() if v is not None}
    jax.distributed.initialize(**kw)
    log.info("process %d of %d, %d device(s) here, %d in all", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def lockstep_config(config: EngineConfig) -> EngineConfig:
    """The config of this process: with several processes each keeps its own disk tier
    (``disk_dir/process-I-of-P``; with only ``snapshot_dir``, ``snapshot_dir/disk_tier/process-I-of-P``;
    else a temporary folder).  ``snapshot_dir`` is shared: one global checkpoint
    (``snapshot_processes.py``)."""
    count, index = jax.process_count(), jax.process_index()
    if count == 1:
        return config
    base = config.disk_dir or (os.path.join(config.snapshot_dir, "disk_tier") if config.snapshot_dir else None)
    if base:
        return dataclasses.replace(config, disk_dir=os.path.join(base, f"process-{index}-of-{count}"))
    return config


class LockstepEngine(Engine):
    """An ``Engine`` whose state-changing calls are repeated in every process (module docstring).

    In the leader each call in ``LOCKSTEP_CALLS`` is broadcast before it runs (calls made inside
    another, such as ``generate``'s ``submit`` and ``step``, are broadcast as themselves; a call made
    by a broadcast call is not broadcast again); in a follower the methods run as ``Engine``'s, made
    by ``follow``."""

    IDLE_WARM = False  # a first run in idle time would be a step the other processes do not run

    def __init__(self, *args, **kwargs):
        self._depth = 0
        self._closed = False
        self._call_time = time.time()
        super().__init__(*args, **kwargs)

    def _send(self, name: str, args: tuple, kwargs: dict) -> dict:
        """(The leader) broadcast the call; returns its keyword arguments as every process makes it."""
        if jax.process_count() == 1:
            return kwargs
        if name == "submit":
            sampling = kwargs.get("sampling")
            if sampling is None or sampling.seed is None:  # one stream for every process
                from inferscale_jax.sampling import SamplingParams
                kwargs = dict(kwargs, sampling=dataclasses.replace(sampling or SamplingParams(),
                                                                   seed=secrets.randbits(63)))
        broadcast_bytes(pickle.dumps((name, args, kwargs, self._call_time)))
        return kwargs

    def now(self) -> float:
        """The leader's clock at the current lockstep call (session expiry agrees in every process)."""
        return self._call_time

    def maybe_snapshot(self) -> bool:
        """(The leader, outside other calls) take a periodic snapshot when one is due, as a lockstep
        ``save_snapshot`` so every process writes its shards at the same point; never raises (a
        failure is logged and backs off, as a background snapshot's would)."""
        p = self.persistence
        if p is None or self._depth or not is_leader() or not p.due():
            return False
        try:
            self.save_snapshot()
        except Exception as err:  # noqa: BLE001 - the save counted and logged it (snapshot.py)
            log.debug("periodic snapshot failed: %r", err)
            return False
        return True


def _lockstep(name: str):
    base = getattr(Engine, name)

    def method(self, *args, **kwargs):
        if self._depth == 0 and is_leader():
            if name == "close":
                if self._closed:
                    return None
                self._closed = True
            self._call_time = time.time()
            kwargs = self._send(name, args, kwargs)
        self._depth += 1
        try:
            out = base(self, *args, **kwargs)
        finally:
            self._depth -= 1
        if name in CHANGES and self._depth == 0:
            self.maybe_snapshot()
        return out

    method.__name__ = name
    method.__doc__ = base.__doc__
    return method


for _name in LOCKSTEP_CALLS:
    setattr(LockstepEngine, _name, _lockstep(_name))


def follow(engine: LockstepEngine) -> None:
    """A follower's loop: make each call the leader broadcasts, until it closes its engine.  A call
    that raises here raised in the leader too (same state, same call): it is logged and skipped."""
    assert not is_leader(), "follow() runs in the processes other than 0"
    while True:
        name, args, kwargs, engine._call_time = pickle.loads(broadcast_bytes(None))
        engine._depth += 1  # made as Engine's: nothing inside is broadcast
        try:
            getattr(Engine, name)(engine, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - the leader got the same error and reported it
            log.debug("lockstep call %s raised %r (as in the leader)", name, err)
        finally:
            engine._depth -= 1
        if name == "close":
            return
