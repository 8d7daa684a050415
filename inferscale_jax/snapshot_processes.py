"""Snapshots of an engine whose mesh spans processes (``distributed.py``): one orbax checkpoint, many writers.

Each process holds only its shards of every segment's KV (its kv heads, ``Tiers.local``), so no
process can write a whole snapshot.  The orbax-native answer is one global checkpoint: every
process turns its numpy parts into a ``jax.Array`` over a CPU mesh of one device per process
(``jax.make_array_from_process_local_data``, split on kv heads like the device pool, or
replicated when every process holds every head), and every process calls the same orbax save;
each writes its own shards, process 0 writes the metadata and commits the step once all have
written (orbax's barriers).  ``snapshot_dir`` must therefore be storage that every process sees
(one machine's disk for several processes on one host; a shared file system across hosts).

What ``snapshot.py`` does differently with several processes (``Spread`` below):

- Saves run on the engine thread, in lockstep: ``save_snapshot`` is a lockstep call and the
  leader alone decides when a periodic one is due (``LockstepEngine.maybe_snapshot``), so every
  process captures the same segments at the same point.  Orbax's barriers are collectives, so a
  background write could interleave them with a device step's; the write is synchronous here.
- The step number is the leader's (``agree``); each process's CRC-32s are gathered into the meta
  (``crc32`` is then a list, one per process).  Process 0 alone deletes old and unfinished steps.
- The registry: process 0's ``registry.sqlite3`` is the record; every other process keeps a
  mirror (``process-I-of-P/registry.sqlite3``).  At restore the leader reads and checks everything
  (``snapshot.py`` restore 1-2) and sends the outcome (rows, step, meta, or the error it raised)
  to every process; the followers mirror those rows, so all restore the same segments, and each
  reads its own shards of the chosen step.  If any process fails to read or check its shards, all
  raise (``all_ok``): no process goes on alone into device steps the others never make.
"""

from __future__ import annotations

import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from inferscale_jax.broadcast import broadcast_bytes


class Spread:
    """The collectives and shardings a snapshot needs across ``jax.process_count()`` processes."""

    def __init__(self, tiers):
        self.count, self.index = jax.process_count(), jax.process_index()
        self.tiers = tiers
        cpus = jax.devices("cpu")
        firsts = [min((d for d in cpus if d.process_index == p), key=lambda d: d.id) for p in range(self.count)]
        self.mesh = Mesh(np.array(firsts), ("p",))
        self.split = tiers.local_heads != tiers.layout[2]
        spec = PartitionSpec(None, None, "p") if self.split else PartitionSpec()
        self.sharding = NamedSharding(self.mesh, spec)
        if self.split:  # process p's part must be heads [p * H/P, (p+1) * H/P), as the CPU mesh splits them
            shape = tiers.shape(1, local=False)
            starts = {(idx[2].start or 0) for d, idx in tiers.device_sharding.devices_indices_map(shape).items()
                      if d.process_index == self.index}
            if min(starts) != self.index * tiers.local_heads:
                raise ValueError(
                    f"snapshots across processes need a mesh whose kv-head shards follow the process order; "
                    f"process {self.index} holds heads from {min(starts)}, not {self.index * tiers.local_heads}: "
                    "serve without snapshot_dir, or build the mesh from jax.devices() in order")

    @property
    def leader(self) -> bool:
        return self.index == 0

    def to_global(self, local: np.ndarray, num_pages: int) -> jax.Array:
        """This process's part of a block -> the global block over the CPU mesh (no copy between processes)."""
        shape = self.tiers.shape(num_pages, local=False)
        return jax.make_array_from_process_local_data(self.sharding, local, shape)

    def restore_args(self, num_pages: int):
        import orbax.checkpoint as ocp

        return ocp.ArrayRestoreArgs(sharding=self.sharding, global_shape=self.tiers.shape(num_pages, local=False))

    def agree(self, obj=None):
        """The leader's ``obj`` in every process (pickled; every process calls this at the same point)."""
        return pickle.loads(broadcast_bytes(pickle.dumps(obj) if self.leader else None))

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every process's list of unsigned 32-bit ints (CRC-32s; all lists the same length), in
        process order.  Sent as bytes: without x64, JAX would narrow int64 to int32."""
        arr = np.asarray([*values, 0], np.uint32).view(np.uint8).reshape(1, -1)  # never empty
        out = np.asarray(multihost_utils.process_allgather(arr, tiled=True), np.uint8)
        return [row.view(np.uint32)[:-1].tolist() for row in out.reshape(self.count, -1)]

    def all_ok(self, ok: bool) -> bool:
        """True in every process when ``ok`` holds in every process."""
        return all(v[0] for v in self.gather([int(ok)]))
