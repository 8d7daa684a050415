"""The runner's persistent page tables (``page_tables.py``) and the packing that reads them.

- random add / remove / append sequences keep every slot's row equal to a from-scratch rebuild
  from the page lists;
- a step's host arrays packed with slots (decode rows gathered from the tables) equal the same
  step packed from the page lists alone, for random ragged steps with and without cascade
  groups, page boundaries included;
- a page list that shrinks or outgrows the row is an error, not a silent stale table.
"""

import random

import numpy as np
import pytest

from inferscale_jax.page_tables import PageTables
from inferscale_jax.runner import StepRow
from tests.support.tiny_engine import make_engine


def rebuilt(lists: dict[int, list[int]], slots: int, width: int) -> np.ndarray:
    table = np.zeros((slots, width), np.int32)
    for slot, pages in lists.items():
        table[slot, :len(pages)] = pages
    return table


@pytest.mark.parametrize("seed", range(5))
def test_random_add_remove_append_equals_a_rebuild(seed):
    rng = random.Random(seed)
    slots, width = 16, 40
    t = PageTables(slots, width)
    lists: dict[int, list[int]] = {}
    for _ in range(600):
        op = rng.random()
        if op < 0.25 and t.free:
            slot = t.add()
            assert slot not in lists and 0 <= slot < slots
            lists[slot] = []
        elif op < 0.4 and lists:
            slot = rng.choice(list(lists))
            t.remove(slot)
            del lists[slot]
        elif lists:
            slot = rng.choice(list(lists))
            room = width - len(lists[slot])
            lists[slot] += [rng.randrange(1, 1000) for _ in range(rng.randint(0, min(3, room)))]
            if rng.random() < 0.7:  # (a row not synced this round catches up with several pages later)
                t.sync(slot, lists[slot])
        if rng.random() < 0.2:
            for slot, pages in lists.items():
                t.sync(slot, pages)
            np.testing.assert_array_equal(t.table, rebuilt(lists, slots, width))
            assert t.free == slots - len(lists)
    assert len(set(range(slots)) - set(lists)) == t.free


def test_gather_takes_each_rows_window_and_zeros_the_rest():
    t = PageTables(4, 10)
    for pages in ([1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]):
        t.sync(t.add(), pages)
    got = t.gather(np.array([2, 0, 1]), np.array([8, 1, 0]), np.array([2, 3, 2]), 4)
    np.testing.assert_array_equal(got, [[16, 17, 0, 0], [2, 3, 4, 0], [6, 7, 0, 0]])


def test_a_page_list_that_shrinks_or_outgrows_the_row_is_an_error():
    t = PageTables(2, 4)
    slot = t.add()
    t.sync(slot, [1, 2, 3])
    with pytest.raises(ValueError, match="pages only grow"):
        t.sync(slot, [1, 2])
    with pytest.raises(ValueError, match="up to 4"):
        t.sync(slot, [1, 2, 3, 4, 5])
    assert t.add() >= 0 and t.add() == -1  # every slot taken: -1 (packed from the page list)


@pytest.mark.parametrize("seed", range(6))
def test_packing_from_the_tables_equals_packing_from_the_page_lists(seed):
    e = make_engine(pages=256, max_batch=16, prefill_chunk=16)
    runner, s = e.runner, e.config.page_size
    rng = random.Random(seed)
    shared = [rng.randrange(1, 255) for _ in range(rng.choice([0, 2, 5]))]  # a cascade group's pages
    rows, groups = [], [len(shared)] if shared else []
    for _ in range(rng.randint(2, 12)):  # decode rows, some in the group, positions across page ends
        pos = rng.randrange(len(shared) * s, 90)
        pages = (shared if rng.random() < 0.6 and shared else [rng.randrange(1, 255) for _ in shared])
        pages = pages + [rng.randrange(1, 255) for _ in range(pos // s + 1 - len(pages))]
        row = StepRow([rng.randrange(1, 90)], pos, pages, temperature=rng.choice([0.0, 0.7]),
                      top_k=rng.choice([0, 5]), key=np.array([seed, pos], np.uint32), sample_step=pos % 7)
        row.group = 0 if shared and pages[:len(shared)] == shared else -1
        rows.append(row)
    if groups and sum(r.group == 0 for r in rows) == 0:
        groups = []
    for _ in range(rng.randint(0, 2)):  # prefill chunks after the decode rows (never a slot's fast path)
        start = rng.randrange(0, 40)
        rows.append(StepRow([rng.randrange(1, 90) for _ in range(rng.randint(2, 9))], start,
                            [rng.randrange(1, 255) for _ in range((start + 9) // s + 1)]))
    src = [rng.choice([-1, 0, 1]) if len(r.tokens) == 1 else -1 for r in rows]
    plain = runner._pack(rows, 0, groups, src)
    for r in rows:  # the same rows, now with slots: one synced earlier (then grown), the others fresh
        if len(r.tokens) == 1:
            r.slot = runner.tables.add()
            if rng.random() < 0.5:
                runner.tables.sync(r.slot, r.pages[:max(1, len(r.pages) - 1)])
    tabled = runner._pack(rows, 0, groups, src)
    assert plain[0] == tabled[0] and plain[1] == tabled[1]  # the bucket, the sampler's variant
    for a, b in zip(plain[2], tabled[2]):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)
    for r in rows:
        if r.slot >= 0:
            assert runner.tables.n[r.slot] == len(r.pages)
