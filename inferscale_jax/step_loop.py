"""The engine-core loop: schedule -> dispatch -> collect -> update, and the overlap state.

The scheduler (``scheduler.py``) only plans: it holds requests, pages and page-table slots, and
no runner.  ``StepLoop.step`` runs one iteration over it and the runner (``runner.py``):

1. ``Scheduler.admit``: admission and requests that failed meanwhile.
2. ``Scheduler.schedule(inflight)``: the next step as plain data (``Planned``: the runner's
   ``StepPlan`` and the scheduler's rows).  ``inflight`` is the step dispatched last and not yet
   read; a request whose token it samples is fed that token on the device.  When the plan needs
   the in-flight step settled first (a preemption, a row whose bias needs its token on the host),
   the answer is ``SETTLE``: the loop reads and applies that step, then plans again.
3. ``runner.dispatch``: the step starts on the device (``Scheduler.dispatched`` counts its rows
   as computed).
4. The previous step is read (``runner.collect``) and applied (``Scheduler.update``) while the
   device computes the new one: the host's work overlaps the device's.  A deferred step (a
   constrained row fed on the device) samples only now, its grammar masks made from the applied
   tokens (``Scheduler.before_sample``, ``runner.sample``).
5. The new step stays in flight (``inflight``) for the next iteration; with
   ``EngineConfig.overlap_decode`` off it is read at once.

A step whose results are lost (its dispatch, read or sampling raised) is forgotten with every
other unread step (``unread``, ``Scheduler.rollback``; an engine-wide fault forgets them too,
``fail_running``), the device is checked (``runner.check_device`` raises ``EngineFault`` for
a lost device), and the next step's rows run one at a time (``Scheduler.rows_alone``), so a row
that fails fails only its request or its node job's requests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from inferscale_jax.request import RequestOutput
from inferscale_jax.runner import PendingStep
from inferscale_jax.sampling import MAX_LOGPROBS
from inferscale_jax.scheduler import SETTLE, Planned, Scheduler

if TYPE_CHECKING:
    from inferscale_jax.kv_manager import KVManager
    from inferscale_jax.runner import ModelRunner

log = logging.getLogger("inferscale.scheduler")


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: KVManager, *, overlap: bool) -> None:
        """``kv``: only for its ``step`` (a row run alone after a lost step, with the page checks)."""
        self.scheduler, self.runner, self.kv, self.overlap = scheduler, runner, kv, overlap
        self.inflight: tuple[PendingStep, Planned] | None = None  # dispatched, not yet read
        # every dispatched step whose results are neither applied nor rolled back (the in-flight
        # one, and the one this iteration dispatched until it is stored or read): what a lost
        # step or an engine-wide fault forgets
        self.unread: list[Planned] = []

    def step(self) -> list[RequestOutput]:
        """One iteration: admit, then one device step of decode rows and prefill chunks."""
        sched = self.scheduler
        outs = sched.admit(idle=self.inflight is None)
        if self.inflight is not None or sched.has_work():
            outs += self._step()
        return outs

    def drain(self) -> list[RequestOutput]:
        """Read the in-flight step (if any) and apply its results."""
        prev, self.inflight = self.inflight, None
        return self._update(prev[1], self.runner.collect(prev[0])) if prev is not None else []

    def fail_running(self, err: Exception) -> list[RequestOutput]:
        """An engine-wide fault: the running requests fail, and the steps not read back are
        forgotten (``Scheduler.rollback``), so a node job's chunk in them is computed again."""
        self.inflight = None
        self.scheduler.rollback(*self.unread)
        self.unread = []
        return self.scheduler.fail_running(err)

    def _update(self, step: Planned, res) -> list[RequestOutput]:
        """Apply a read-back step (``Scheduler.update``); from then on it is not unread."""
        outs = self.scheduler.update(step, res)
        self.unread.remove(step)  # (by identity: Planned compares as itself)
        return outs

    def _step(self) -> list[RequestOutput]:
        sched, runner = self.scheduler, self.runner
        outs: list[RequestOutput] = []
        while True:
            planned = sched.schedule(self.inflight[1] if self.inflight is not None else None)
            if planned is not SETTLE:
                break
            settled, lost = self._settle()
            outs += settled
            if lost:
                return outs
        prev, pending, failure = self.inflight, None, None
        if planned is not None:
            try:
                if planned.defer:
                    pending = runner.dispatch(planned.plan, prev[0], defer_sample=True)
                else:
                    pending = runner.dispatch(planned.plan, prev[0] if planned.plan.src is not None else None)
            except Exception as err:  # noqa: BLE001 - settled below, request by request
                failure = err
            else:
                sched.dispatched(planned)
                self.unread.append(planned)
        if prev is not None:  # the device is busy with `pending` meanwhile
            self.inflight = None
            try:
                res = runner.collect(prev[0])
            except Exception as err:  # noqa: BLE001 - the previous step's results are lost
                # `pending` was fed that step's ids: it is lost too
                return outs + self._lost(err)
            outs += self._update(prev[1], res)
        if failure is not None:
            return outs + self._lost(failure)
        if pending is None:
            return outs
        if planned.defer:  # the fed tokens are applied: the masks can be made
            sched.before_sample(planned)
            try:
                pending = runner.sample(pending)
            except Exception as err:  # noqa: BLE001 - its results are lost: recompute
                return outs + self._lost(err)
        if not self.overlap:
            try:
                res = runner.collect(pending)
            except Exception as err:  # noqa: BLE001 - its results are lost: recompute
                return outs + self._lost(err)
            return outs + self._update(planned, res)
        self.inflight = (pending, planned)
        return outs

    def _settle(self) -> tuple[list[RequestOutput], bool]:
        """Read the in-flight step now and apply it: (its outputs, whether its results were lost -
        then the outputs are ``_lost``'s and the iteration ends)."""
        prev, self.inflight = self.inflight, None
        try:
            res = self.runner.collect(prev[0])
        except Exception as err:  # noqa: BLE001 - its results are lost: recompute
            return self._lost(err), True
        return self._update(prev[1], res), False

    def _lost(self, err: Exception) -> list[RequestOutput]:
        """A step failed (``err``) or its results were lost: forget every unread step (the one
        that failed, and one fed its ids), then run every row of the next step alone, failing only
        the requests (or node jobs) whose row fails."""
        self.inflight = None
        sched = self.scheduler
        sched.rollback(*self.unread)
        self.unread = []
        self.runner.check_device(err)
        owners, rows = sched.rows_alone()
        log.warning("a step failed (%s: %s); running the %d rows of the next one one at a time",
                    type(err).__name__, err, len(rows))
        outs: list[RequestOutput] = []
        done = []
        for owner, row in zip(owners, rows):
            seq = owner.seq
            try:  # (the row's KV chores first, when it is its sequence's first row)
                res = self.kv.step([row], MAX_LOGPROBS if owner.wants_logprobs else 0,
                                   splices=seq.splices if seq is not None else None)
                if seq is not None:
                    seq.splices = []
            except Exception as one:  # noqa: BLE001 - this row's failure
                self.runner.check_device(one)
                outs += sched.fail(owner, one)
                continue
            done.append((owner, row, res))
        return outs + sched.apply_alone(done)
