"""Bytes from process 0 to every process of a multi-process JAX program.

``broadcast_bytes`` is a collective: every process calls it at the same point, the leader (process
0) with its payload, the others with ``None``, and all get the leader's bytes back.  It rides on
``jax.experimental.multihost_utils.broadcast_one_to_all`` (NCCL on GPUs, gloo on CPUs): a first
broadcast of ``HEAD_BYTES`` carries a 4-byte length and the payload's start, which is the whole of a
small payload (an engine ``step`` call); a longer one sends its rest in a second broadcast padded to
a power of two, so only a few shapes ever compile.  Used by the lockstep engine
(``distributed.py``) and by the multi-process snapshot (``snapshot_processes.py``).
"""

from __future__ import annotations

import jax
import numpy as np

HEAD_BYTES = 1024  # bytes of the first broadcast: a 4-byte length and the start of the payload


def is_leader() -> bool:
    """Whether this is process 0, the one whose bytes ``broadcast_bytes`` sends."""
    return jax.process_index() == 0


def broadcast_bytes(payload: bytes | None) -> bytes:
    """The leader's ``payload`` in every process (a collective: every process calls it; the others
    pass ``None``)."""
    from jax.experimental import multihost_utils

    leader = is_leader()
    head = np.zeros(HEAD_BYTES, np.uint8)
    if leader:
        data = len(payload).to_bytes(4, "little") + payload
        head[:min(len(data), HEAD_BYTES)] = np.frombuffer(data[:HEAD_BYTES], np.uint8)
    head = np.asarray(multihost_utils.broadcast_one_to_all(head))
    n = int.from_bytes(head[:4].tobytes(), "little")
    if n <= HEAD_BYTES - 4:
        return head[4:4 + n].tobytes()
    rest = n - (HEAD_BYTES - 4)
    buf = np.zeros(1 << max(8, (rest - 1).bit_length()), np.uint8)
    if leader:
        buf[:rest] = np.frombuffer(payload[HEAD_BYTES - 4:], np.uint8)
    return head[4:].tobytes() + np.asarray(multihost_utils.broadcast_one_to_all(buf))[:rest].tobytes()
