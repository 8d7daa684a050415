"""The runner's persistent page tables: one slot-indexed numpy row per running request.

A decode step packs, for each of up to ``max_batch`` rows, the row's page table (the pages past
its cascade group's shared ones, up to its last token).  Copying each row's Python page list
into the step's array was a per-row cost of every step; here each running request owns a slot
(``Request.slot``, taken when it first decodes, given back when it leaves the running set), the
slot's row is written once and then changed by diffs (a request's pages only ever grow at the end
while it runs: ``sync`` appends the new ones), and packing gathers all rows at once with numpy
fancy indexing (``ModelRunner._pack``).

The Python list ``n`` (pages written per slot) is what ``sync`` compares with ``len(pages)``: one
integer comparison per row per step, so a page appended anywhere (the scheduler's growth, a
recovery) reaches the table before the row is packed.
"""

from __future__ import annotations

import numpy as np


class PageTables:
    """``slots`` page-table rows of ``width`` pages each (int32; unused entries 0, the null page)."""

    def __init__(self, slots: int, width: int):
        self.table = np.zeros((slots, width), np.int32)
        self.width = width
        self.n = [0] * slots  # pages written in each slot's row
        self._free = list(range(slots - 1, -1, -1))  # (pop() takes the lowest slot)

    @property
    def free(self) -> int:
        return len(self._free)

    def add(self) -> int:
        """A free slot (its row empty), or -1 when every slot is taken (the row is then packed
        from its page list, as rows without a slot are)."""
        return self._free.pop() if self._free else -1

    def remove(self, slot: int) -> None:
        """Give ``slot`` back (its row cleared)."""
        self.table[slot, :self.n[slot]] = 0
        self.n[slot] = 0
        self._free.append(slot)

    def sync(self, slot: int, pages: list[int]) -> None:
        """Make ``slot``'s row equal ``pages``, which extend the pages already written (appended
        at the end since; anything else is a bug and raises)."""
        k, m = self.n[slot], len(pages)
        if m < k or m > self.width:
            raise ValueError(f"slot {slot}: a page list of {m} pages cannot follow the {k} written "
                             f"(pages only grow, up to {self.width})")
        self.table[slot, k:m] = pages[k:]
        self.n[slot] = m

    def gather(self, slots: np.ndarray, first: np.ndarray, count: np.ndarray, width: int) -> np.ndarray:
        """[len(slots), width] int32: row i holds pages ``first[i] .. first[i] + count[i] - 1`` of
        slot ``slots[i]``, then zeros (the null page)."""
        cols = np.arange(width, dtype=np.int32)
        idx = np.minimum(first[:, None] + cols[None, :], self.width - 1)
        out = self.table[slots[:, None], idx]
        out[cols[None, :] >= count[:, None]] = 0
        return out
