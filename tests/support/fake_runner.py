"""A model-free runner for scheduler tests: it records every step the scheduler plans and
"samples" a token that depends only on the position it is sampled for, so any schedule of a
request gives the same output and the tests can look at the plans alone."""

import numpy as np

from inferscale_jax.runner import ModelRunner, PendingStep, StepResult


def token_at(pos: int, vocab: int) -> int:
    """The fake model's next token after position ``pos``."""
    return (7 * pos + 3) % (vocab - 1) + 1


class FakeRunner(ModelRunner):
    """ModelRunner with the device left out: ``dispatch`` checks the step against the bucket set
    (as the real one does), records it, and returns ids ``token_at(last position)``."""

    def __init__(self, real: ModelRunner):
        self.__dict__.update(real.__dict__)
        self.steps: list[list[tuple[int, int, bool]]] = []  # per step: (start, tokens, cascade) per row
        self.splices: list[list] = []  # per step: the KV chores its plan carried

    def dispatch(self, plan, prev=None):
        rows, num_logprobs, groups = plan.rows, plan.num_logprobs, plan.groups
        total = sum(len(r.tokens) for r in rows)
        need = max(-(-(r.start + len(r.tokens)) // self.page_size) - (groups[r.group] if r.group >= 0 else 0)
                   for r in rows)
        # asserts the step fits a bucket
        self.buckets.key(len(rows), total, need, num_logprobs, max(groups, default=0), len(groups))
        self.steps.append([(r.start, len(r.tokens), r.cascade) for r in rows])
        self.splices.append(list(plan.splices))
        vocab = self.cfg.vocab_size
        ids = np.array([token_at(r.start + len(r.tokens) - 1, vocab) for r in rows], np.int32)
        return PendingStep(ids, len(rows), 0, num_logprobs, self.max_batch)

    def collect(self, pending):
        n, k = pending.n, pending.num_logprobs
        return StepResult(np.asarray(pending.packed), np.zeros(n, np.float32), np.zeros((n, k), np.int32),
                          np.zeros((n, k), np.float32))

    def splice(self, src_slots, dst_slots, shift):
        pass
