"""Child process of the journal tests (test_registry_journal.py): segment writes acknowledged one
by one on stdout, then killed with SIGKILL by the parent.

    python tests/support/journal_child.py DIR script OPS_JSON   # the writes in OPS_JSON, then idle until killed
    python tests/support/journal_child.py DIR loop SEED         # restore, report the state, then random writes forever
    python tests/support/journal_child.py DIR crash JSON        # {"ops": OPS, "at": "journaled"|"committed"}:
                                        # the last op dies (os._exit) right before / after its COMMIT

Every line is JSON: ``{"state": {id: [version, tokens]}, "restore": {...}}`` first (what the
restore brought back, and its counters), then per write ``{"begin": op}`` before it and
``{"ack": op}`` after it returned (``op`` = ``[kind, id, tokens]``; kind register, update, append,
delete or snapshot).  In loop mode it also checks one segment's greedy answer against a full prefill
of its tokens right after the restore and reports ``{"exact": bool, "id": ...}``.
"""

import json
import os
import random
import sys

# Run as a file: the repository root goes on sys.path (tests.support, inferscale_jax, models).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.support.tiers_common import PROMPT, SP, make_engine  # noqa: E402


def say(**kw):
    print(json.dumps(kw), flush=True)


def state(engine) -> dict:
    return {i.id: [i.version, list(engine.store.resolve(i.id, "t").token_ids)] for i in engine.list_segments("t")}


def apply(engine, op) -> None:
    kind, sid, tokens = op
    if kind == "register":
        engine.register_segment(sid, token_ids=tokens, tenant="t")
    elif kind == "update":
        engine.update_segment(sid, token_ids=tokens, tenant="t")
    elif kind == "append":
        engine.append_segment(sid, token_ids=tokens, tenant="t")
    elif kind == "delete":
        engine.delete_segment(sid, tenant="t")
    elif kind == "snapshot":
        engine.save_snapshot()


def run(engine, ops) -> None:
    for op in ops:
        say(begin=op)
        apply(engine, op)
        say(ack=op)


class DieAtCommit:
    """The registry's connection, dying at the next COMMIT: before it runs ("journaled": the
    journal line is written, the transaction not) or right after it ("committed")."""

    def __init__(self, db, at: str):
        self.db, self.at = db, at

    def execute(self, sql, *args):
        if sql.startswith("COMMIT") and self.at == "journaled":
            os._exit(9)
        out = self.db.execute(sql, *args)
        if sql.startswith("COMMIT"):
            os._exit(9)
        return out

    def __getattr__(self, name):
        return getattr(self.db, name)


def random_op(rng: random.Random, have: set, serial: list[int]) -> list:
    toks = [rng.randrange(1, 90) for _ in range(rng.randrange(9, 30))]
    kind = rng.choice(["register"] * 3 + ["update", "append", "delete"] * 2 + ["snapshot"] if have else ["register"])
    if kind == "register":
        serial[0] += 1
        return ["register", f"s{serial[0]}", toks]
    if kind == "snapshot":
        return ["snapshot", "", []]
    sid = rng.choice(sorted(have))
    if kind == "append":
        return ["append", sid, toks[:rng.randrange(1, 9)]]
    return [kind, sid, toks]


def main(folder: str, mode: str, arg: str) -> None:
    engine = make_engine(snapshot_dir=folder)
    st = engine.stats()["snapshot"]
    have = state(engine)
    say(state=have, restore={k: st[k] for k in ("rebuilt", "redone", "lost_writes", "recomputed", "restored_step")})
    if mode == "script":
        run(engine, json.loads(arg))
    elif mode == "crash":
        plan = json.loads(arg)
        run(engine, plan["ops"][:-1])
        reg = engine.persistence.registry
        reg._db = DieAtCommit(reg._db, plan["at"])
        run(engine, plan["ops"][-1:])
    else:
        rng = random.Random(int(arg))
        if have:  # injected == full prefill, for one restored segment
            sid = rng.choice(sorted(have))
            inj = engine.generate(prompt_token_ids=PROMPT, segments=[sid], tenant="t", sampling=SP).token_ids
            full = engine.generate(prompt_token_ids=have[sid][1] + PROMPT, tenant="t", sampling=SP).token_ids
            say(exact=inj == full, id=sid)
        ids = set(have)
        serial = [1000 * int(arg)]
        while True:
            op = random_op(rng, ids, serial)
            run(engine, [op])
            if op[0] == "register":
                ids.add(op[1])
            elif op[0] == "delete":
                ids.discard(op[1])
    say(idle=True)
    sys.stdin.read()  # until killed


if __name__ == "__main__":
    main(*sys.argv[1:4])
