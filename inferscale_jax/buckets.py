"""Step shape buckets: the few static shapes every device step is padded to.

A jitted step compiles once per static shape, so the runner pads each step to a *bucket*.  The
set is derived from the engine's config alone, finite and small, so ``Engine.warmup`` can
compile all of it before serving and nothing compiles afterwards:

* **decode steps** (every row feeds one token): ``rows`` buckets, powers of two from 8 up to
  ``max_rows`` (the last bucket is ``max_rows`` itself); the flat token count equals the rows.
  Padding rows cost one query over the null page; the weights are read once per step whatever
  the row count, so 8 rows cost about what 1 does.
* **mixed steps** (some row computes a prefill chunk; decode rows ride along): ``tokens``
  buckets, powers of two from 32 up to the step's token budget
  (``EngineConfig.max_num_batched_tokens``, the last bucket is the budget itself; midpoint buckets
  384 / 768 gained nothing served and cost 25 s of cold start: bench/NOTES.md, run AK); the row
  count is then tied to the token bucket (``min(tokens, max_rows)``), so a mixed step has a
  single free dimension.  The LM head and the sampler run over that many rows; at most the
  chunk's own cost over again for the smallest buckets, a fraction of a percent for big ones.
* **page-table width**: a step's table is padded to one of a few widths, each 8x the next:
  ``next_pow2(max_pages_per_seq)``, /8, /64, ... down to ``min_table_pages``.  Mixed and
  cascade steps, and decode steps of ``NARROW_ROWS`` rows or more, always use the widest (their
  kernels' work follows the real lengths; only a few more int32 per row travel); decode steps
  of fewer rows pick the narrowest that holds their longest row, because there the decode
  kernel splits each sequence across the GPU's cores by the table width.  With the jnp
  reference attention (``narrow_mixed``: the CPU default) mixed steps pick the narrowest width
  too (but never the very narrowest), since the reference gathers every table slot for every
  new token.
* **cascade** decode steps (groups of rows each read their shared prefix once): the group
  table's page lists take the widest table width (the shared kernel's work follows each group's
  real length, its splits included), and the group count one of ``GROUP_BUCKETS`` (at most
  ``MAX_GROUPS`` groups a step); a row bucket ``r`` takes the group buckets up to the first that
  holds ``r // 2`` groups (a decode step's group has at least two rows).  Extra groups in a bucket
  cost only empty programs of the shared kernel.  A mixed step whose rows form cascade groups
  takes the smallest of its warmed group buckets that holds its groups: the ``MIXED_FIT_GROUPS``
  buckets up to the most its rows can hold (``mixed_groups``: every group has two rows or more, a
  prefill chunk joining only a group with a decode row; ``key`` still takes a bigger group bucket if
  a step ever held more groups, which would compile when first needed), the widest page lists.  The
  shared kernel's static grid has a row block per group of the table
  (``cascade_attention.num_row_blocks``): 72 row blocks for a 128-token step with a 64-group table,
  24 with a 16-group one (96 / 48 at 512 tokens); the bare loop's mixed steps ran 1.5-3% faster
  than in the 64-group bucket alone (bench/NOTES.md, run AS).  ``INFERSCALE_MIXED_GROUPS=max`` (an
  A/B switch for the benchmarks) gives every mixed step the most its rows can hold, one cascade
  bucket per token bucket (for 64 rows and a 2048-token budget, 12 buckets fewer to compile).
* **log-probs**: 0 or ``MAX_LOGPROBS`` columns.

**Warm-up sets** (``warmup_keys``): ``all`` is every bucket above; ``small`` keeps what a small
server runs - decode steps of the smallest row bucket over the narrow table widths, and mixed
steps of up to ``SMALL_TOKENS`` new tokens, without log-probs or cascade.  ``auto`` is ``small`` on
the CPU, where each step compiles for seconds and a server with every bucket took minutes to
start, and ``all`` on a GPU or TPU.  A bucket outside the set compiles when a step first needs
it (logged at INFO, not as a warning: the set left it out on purpose).

Penalty steps (a row with presence / frequency / repetition penalty) add id arrays whose width
follows the requests' lengths (``runner.penalty_width``); they are not part of the warm-up set
and compile on first use (counted and logged like any compile after warm-up).

``padding`` accumulates real vs padded tokens and rows, reported by ``Engine.stats()``.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.common import env_choice


NARROW_ROWS = 32  # decode row buckets below this pick a table width (see the module docstring)
GROUP_BUCKETS = (1, 4, 16, 64)  # cascade: padded group counts of a step
MAX_GROUPS = GROUP_BUCKETS[-1]  # cascade groups one step can hold
MIXED_FIT_GROUPS = 16  # mixed steps' group buckets start here (module docstring; INFERSCALE_MIXED_GROUPS=fit)
MIXED_GROUPS_CHOICES = ("fit", "max")
SMALL_TOKENS = 128  # the ``small`` warm-up set: mixed steps of up to this many new tokens
SMALL_WIDTHS = 2  # the ``small`` warm-up set: decode steps over the narrowest widths (<= 512 tokens at page 16)
WARMUP_SETS = ("auto", "small", "all")


def mixed_groups_mode() -> str:
    """``INFERSCALE_MIXED_GROUPS``: ``fit`` (the default: a mixed step takes the smallest warmed group
    bucket that holds its groups) or ``max`` (one group bucket per mixed token bucket, the most its
    rows can hold): module docstring."""
    return env_choice("INFERSCALE_MIXED_GROUPS", MIXED_GROUPS_CHOICES)


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _ladder(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` while below ``hi``, then ``hi`` itself."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


@dataclasses.dataclass(frozen=True)
class StepKey:
    """The static shape of one step (one compiled executable, penalties aside)."""
    rows: int
    tokens: int
    width: int  # page-table width
    num_logprobs: int
    shared: int = 0  # cascade: padded shared page count of the group table (0: no cascade)
    groups: int = 0  # cascade: padded group count (one of GROUP_BUCKETS; 0: no cascade)
    ragged: bool = False  # a mixed step (ragged attention); else every row feeds one token


class StepBuckets:
    def __init__(self, *, max_rows: int, max_tokens: int, max_pages_per_seq: int, min_table_pages: int = 4,
                 num_logprobs: int = 20, min_rows: int = 8, min_tokens: int = 32, narrow_mixed: bool = False):
        assert max_tokens >= max_rows, "the token budget must hold a decode token for every row"
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.narrow_mixed = narrow_mixed  # mixed steps without cascade pick a table width (module docstring)
        self.num_logprobs = num_logprobs
        self.row_buckets = _ladder(min(min_rows, max_rows), max_rows)
        self.token_buckets = _ladder(min(min_tokens, max_tokens), max_tokens)
        widest = next_pow2(max_pages_per_seq, 4)
        widths = [widest]
        while widths[-1] // 8 >= max(1, min_table_pages):
            widths.append(widths[-1] // 8)
        self.widths = sorted(widths)
        # a mixed step's widths: the widest; with narrow_mixed all but the narrowest (it would add a
        # compile for prompts of a few pages only)
        self.mixed_widths = self.widths[min(1, len(self.widths) - 1):] if narrow_mixed else self.widths[-1:]
        self.mixed_fit = mixed_groups_mode() == "fit"
        self.real_tokens = self.padded_tokens = self.real_rows = self.padded_rows = 0

    # -- choosing -------------------------------------------------------------------------
    def rows_for(self, n: int) -> int:
        return next(b for b in self.row_buckets if b >= n)

    def tokens_for(self, n: int) -> int:
        """The token bucket of a mixed step of ``n`` new tokens."""
        return next(b for b in self.token_buckets if b >= n)

    def width_for(self, pages: int) -> int:
        return next((w for w in self.widths if w >= pages), max(pages, self.widths[-1]))

    def wide(self, pages: int) -> int:
        return max(self.widths[-1], pages)

    @staticmethod
    def groups_for(n: int) -> int:
        assert 0 < n <= MAX_GROUPS, f"{n} cascade groups: at most {MAX_GROUPS} a step"
        return next(g for g in GROUP_BUCKETS if g >= n)

    @staticmethod
    def group_buckets(rows: int) -> list[int]:
        """The group buckets a step of ``rows`` rows can take (groups of >= 2 rows)."""
        return [g for i, g in enumerate(GROUP_BUCKETS) if i == 0 or GROUP_BUCKETS[i - 1] < rows // 2]

    def mixed_groups(self, rows: int) -> int:
        """The group bucket of a mixed step of ``rows`` (bucketed) rows: the most its decode rows can hold."""
        return self.groups_for(min(MAX_GROUPS, max(1, rows // 2)))

    def mixed_group_buckets(self, rows: int) -> list[int]:
        """The warmed group buckets of a mixed step of ``rows`` (bucketed) rows, smallest first:
        ``mixed_groups``, and (unless ``INFERSCALE_MIXED_GROUPS=max``) the ``MIXED_FIT_GROUPS`` buckets
        and up below it."""
        most = self.mixed_groups(rows)
        fit = [g for g in GROUP_BUCKETS if MIXED_FIT_GROUPS <= g < most] if self.mixed_fit else []
        return fit + [most]

    def key(self, n_rows: int, n_tokens: int, need_pages: int, num_logprobs: int, shared_pages: int = 0,
            groups: int = 0) -> StepKey:
        """The bucket of a step of ``n_rows`` rows and ``n_tokens`` new tokens whose longest row
        needs ``need_pages`` table entries (cascade: ``groups`` groups whose longest shared page
        list is ``shared_pages``)."""
        assert 0 < n_rows <= self.max_rows and n_rows <= n_tokens <= self.max_tokens, (n_rows, n_tokens)
        nl = self.num_logprobs if num_logprobs else 0
        if n_tokens == n_rows:  # decode: one token per row
            r = self.rows_for(n_rows)
            if shared_pages:
                return StepKey(r, r, self.widths[-1], nl, self.wide(shared_pages), self.groups_for(max(groups, 1)))
            return StepKey(r, r, self.width_for(need_pages) if r < NARROW_ROWS else self.wide(need_pages), nl)
        t = self.tokens_for(n_tokens)
        r = min(t, self.max_rows)
        if shared_pages:
            need = max(1, min(groups, MAX_GROUPS))
            g = next((c for c in self.mixed_group_buckets(r) if c >= need), self.groups_for(need))
            return StepKey(r, t, self.wide(need_pages), nl, self.wide(shared_pages), g, ragged=True)
        return StepKey(r, t, max(self.width_for(need_pages), self.mixed_widths[0]) if self.narrow_mixed
                       else self.wide(need_pages), nl, ragged=True)

    def count(self, key: StepKey, n_rows: int, n_tokens: int) -> None:
        self.real_tokens += n_tokens
        self.padded_tokens += key.tokens
        self.real_rows += n_rows
        self.padded_rows += key.rows

    # -- warm-up --------------------------------------------------------------------------
    def all_keys(self, cascade: bool = True) -> list[StepKey]:
        """Every bucket a step without penalties can take (``Engine.warmup`` compiles them)."""
        keys = []
        for nl in (0, self.num_logprobs):
            for r in self.row_buckets:
                keys += [StepKey(r, r, w, nl) for w in (self.widths if r < NARROW_ROWS else self.widths[-1:])]
                if cascade and r >= 2:
                    keys += [StepKey(r, r, self.widths[-1], nl, self.widths[-1], g) for g in self.group_buckets(r)]
            keys += [StepKey(min(t, self.max_rows), t, w, nl, ragged=True) for t in self.token_buckets
                     for w in self.mixed_widths]
            if cascade:
                keys += [StepKey(r, t, self.widths[-1], nl, self.widths[-1], g, ragged=True)
                         for t in self.token_buckets if (r := min(t, self.max_rows)) >= 3
                         for g in self.mixed_group_buckets(r)]
        return list(dict.fromkeys(keys))

    def warmup_keys(self, which: str = "all", *, cascade: bool = True, logprobs: bool = True) -> list[StepKey]:
        """The buckets of warm-up set ``which`` ("small" or "all"; module docstring), without the
        cascade or log-prob buckets when those are off."""
        if which not in ("small", "all"):
            raise ValueError(f"warm-up set {which!r} is invalid: must be 'small' or 'all' ('auto' is resolved "
                             "by Engine.warmup)")
        keys = [k for k in self.all_keys(cascade) if logprobs or not k.num_logprobs]
        if which == "small":
            narrow = self.widths[:SMALL_WIDTHS]
            keys = [k for k in keys if not k.num_logprobs and not k.shared and (
                k.tokens <= max(SMALL_TOKENS, self.token_buckets[0]) and (
                    k.width == self.mixed_widths[0]) if k.ragged
                else k.rows == self.row_buckets[0] and k.width in narrow)]
        return keys

    def padding_stats(self) -> dict:
        return {
            "padding_token_fraction": 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0,
            "padding_row_fraction": 1 - self.real_rows / self.padded_rows if self.padded_rows else 0.0,
        }
