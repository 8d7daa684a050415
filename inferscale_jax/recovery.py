"""Registry recovery at startup: redo the acknowledged writes the registry lost, or name them.

``Registry`` (``registry.py``) sets ``lost_writes`` when its ``write_seq`` is below the last write
its journal (``journal.py``) holds: the registry's write-ahead log was deleted, cut or changed
after a crash, the file was replaced or moved aside by ``repair``, or a crash came between a
write's journal line and its COMMIT (that write, never acknowledged, is redone whole).  Before the
restore reads any row, ``recover``:

1. Picks a base the journal can bring up to date: the registry as it is, when the journal holds
   every write after its ``write_seq``; else the committed snapshot's rows (its manifest records
   every segment's id, tenant, version and token ids, and the registry write it reflects), when
   the journal holds every write after that.  The journal is compacted to what the committed
   snapshot lacks, so one of the two always reaches, unless the journal itself is damaged or the
   snapshot is unreadable.
2. Redoes the journal's records past the base in one registry transaction (registrations, new
   versions, deletions, segment metadata, in order).
3. When some acknowledged write can be redone from neither (its journal line damaged, or its
   record no longer applies), nothing is changed and the start is refused with
   ``SnapshotCorrupt`` naming each lost write by id and the fix; with
   ``EngineConfig.repair_registry`` (``serve --repair``) the rebuild goes on from the base that
   loses least, and every lost write is logged by id as an error and counted
   (``inferscale_integrity_errors_total{tier="registry"}``): reported, never silently absent.

A full recovery is a logged warning naming the writes redone.  The KV of redone segments is
recomputed from their token ids by the restore that follows (their uids are in no snapshot).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from inferscale_jax.errors import SnapshotCorrupt
from inferscale_jax.registry import RedoFailed, SegmentRow, describe

if TYPE_CHECKING:
    from inferscale_jax.snapshot import Persistence

log = logging.getLogger("inferscale.snapshot")


def _snapshot_base(p: "Persistence", step: int | None = None) -> tuple[tuple[list[SegmentRow], int, int] | None, str]:
    """The rows of snapshot ``step`` (default: the committed one), the registry write they
    reflect and the step, or ``None`` and why it cannot serve (no snapshot, another engine's,
    unreadable)."""
    step = p._committed_step() if step is None else step
    if step is None:
        return None, f"there is no snapshot in {p.snap_dir}"
    path = os.path.join(p.snap_dir, str(step))
    try:
        meta = p.read_meta(path)
        why = p.identity.mismatch(p.meta_identity(meta))
        if why is not None or "registry_write_seq" not in meta:
            return None, f"snapshot {path} cannot serve: {why or 'it does not record its registry write'}"
        return (p.snapshot_rows(path, meta["segments"]), int(meta["registry_write_seq"]), step), ""
    except Exception as err:  # noqa: BLE001 - an unreadable snapshot is no base; the restore reports it
        return None, f"snapshot {path} cannot serve ({type(err).__name__}: {err})"


def recover(p: "Persistence") -> None:
    reg = p.registry
    if reg.moved_aside:
        log.warning("the segment registry %s failed its check: moved aside to %s (repair), rebuilding it from the "
                    "newest snapshot and the journal %s", reg.path, reg.moved_aside, reg.journal.path)
    if reg.checkpoint_cut:
        _rebuild_whole(p)
        return
    if not reg.lost_writes:
        return
    repair = p.kv.config.repair_registry
    journal, have = reg.journaled, reg.write_seq()
    bases = [(None, have, f"its own rows (write {have})")]
    snap_note = ""
    if journal.missing(have):
        snap, snap_note = _snapshot_base(p)
        if snap is not None:
            path = os.path.join(p.snap_dir, str(snap[2]))
            bases.append((snap[0], snap[1], f"snapshot {path} ({len(snap[0])} segment(s) at write {snap[1]})"))
            snap_note = f"snapshot {path} reflects writes up to {snap[1]}"
    base, base_seq, source = min(bases, key=lambda b: len(journal.missing(b[1])))
    lost = _lost(journal, base_seq)
    records = journal.after(base_seq)
    if lost and not repair:
        raise _refusal(reg, have, journal.acked, lost, snap_note)
    back = []
    if base is not None:  # name what the snapshot brought back
        held = {(r.namespace, r.id, r.uid) for r in reg.contents()}
        back = [r for r in base if (r.namespace, r.id, r.uid) not in held]
        source += f", bringing back {len(back)}: " + ", ".join(repr(r.id) for r in back[:5]) + (
            ", ..." if len(back) > 5 else "")
    try:
        failed = reg.redo(base, base_seq, records, allow_failures=repair)
    except RedoFailed as err:
        raise _refusal(reg, have, journal.acked, lost + err.failed, snap_note) from None
    redone = [describe(r) for r in records]
    log.warning("the segment registry %s lacked %d journaled write(s) (a damaged write-ahead log, a replaced file, "
                "or a crash between a write's journal line and its commit): rebuilt from %s and %d write(s) redone "
                "from the journal %s%s", reg.path, journal.acked - have,
                source, len(records), reg.journal.path,
                (": " + "; ".join(redone[:5]) + ("; ..." if len(redone) > 5 else "")) if redone else "")
    lost += failed
    p.counters["redone"] = len(records) - len(failed)
    p.counters["rebuilt"] = len(back)
    if lost:
        p.kv.tiers.counters["integrity_errors_registry"] += len(lost)
        p.counters["lost_writes"], p.lost_writes = len(lost), lost
        for what in lost:
            log.error("integrity error: acknowledged %s - lost (repair went on without it)", what)


def _rebuild_whole(p: "Persistence") -> None:
    """A checkpoint of the registry's log was cut short by a crash (``Registry.checkpoint_cut``):
    the main file may mix pages from before and after it, which only the log mends, and the log
    may be gone.  The rows are rebuilt from the snapshot the journal's header names (or from none,
    when the journal starts at the first write) plus the journal's records."""
    reg = p.registry
    journal = reg.journaled
    if journal.step is not None:
        snap, why = _snapshot_base(p, journal.step)
        if snap is None or snap[1] != journal.base:
            why = why or f"snapshot {journal.step} reflects write {snap[1]}, the journal starts after {journal.base}"
            log.error("a checkpoint of the segment registry %s was cut short by a crash, and the journal %s cannot "
                      "rebuild it (%s): going on with the file as it is", reg.path, reg.journal.path, why)
            reg.checkpoint()
            return
        base, source = snap[0], f"snapshot {journal.step}"
    elif journal.exists and journal.base == 0:
        base, source = [], "no snapshot"
    else:
        log.error("a checkpoint of the segment registry %s was cut short by a crash, and its journal %s does not "
                  "reach back to a snapshot: going on with the file as it is", reg.path, reg.journal.path)
        reg.checkpoint()
        return
    lost = _lost(journal, journal.base)
    if lost and not p.kv.config.repair_registry:
        raise _refusal(reg, reg.write_seq(), journal.acked, lost, f"rebuilding from {source}")
    records = journal.after(journal.base)
    try:
        failed = reg.redo(base, journal.base, records, allow_failures=p.kv.config.repair_registry)
    except RedoFailed as err:
        raise _refusal(reg, reg.write_seq(), journal.acked, lost + err.failed, f"rebuilding from {source}") from None
    reg.checkpoint()
    lost += failed
    log.warning("a checkpoint of the segment registry %s was cut short by a crash: its rows were rebuilt from %s "
                "(%d segment(s) at write %d) and %d write(s) of the journal %s", reg.path, source, len(base),
                journal.base, len(records), reg.journal.path)
    p.counters["redone"] = len(records) - len(failed)
    if lost:
        p.kv.tiers.counters["integrity_errors_registry"] += len(lost)
        p.counters["lost_writes"], p.lost_writes = len(lost), lost
        for what in lost:
            log.error("integrity error: acknowledged %s - lost (the rebuild went on without it)", what)


def _lost(journal, base_seq: int) -> list[str]:
    """The acknowledged writes past ``base_seq`` the journal cannot redo, each named: by what its
    damaged line still says (unverified), else by its number."""
    claims = {c["seq"]: (n, c) for n, c in journal.damaged if c is not None}
    out = []
    for seq in journal.missing(base_seq):
        if seq in claims:
            n, c = claims.pop(seq)
            try:
                what = describe(c)
            except (KeyError, TypeError):
                what = f"write {seq}"
            out.append(f"{what} (journal line {n} is damaged: unverified)")
        else:
            out.append(f"write {seq}: its journal record is missing")
    out += [f"journal line {n} is damaged (past the last write it proves)" for n, c in journal.damaged
            if c is None or c["seq"] > journal.acked]
    return out


def _refusal(reg, have: int, acked: int, lost: list[str], snap_note: str) -> SnapshotCorrupt:
    names = "; ".join(lost[:10]) + ("; ..." if len(lost) > 10 else "")
    return SnapshotCorrupt(
        f"the segment registry {reg.path} is missing {acked - have} acknowledged write(s) (it holds write {have}, its "
        f"journal {reg.journal.path} proves {acked}), and {len(lost)} of them can be redone neither from the journal "
        f"nor from the newest snapshot ({snap_note or 'not needed'}): {names}. Nothing was changed. Restore the registry files (registry.sqlite3, "
        f"its -wal and its .journal) from a backup; or start with --repair (EngineConfig.repair_registry=True) to "
        f"rebuild from the newest snapshot and the journal and report these writes as lost")

