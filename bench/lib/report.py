"""What every benchmark script shares: console log, markdown tables, guarded sections.

A script imports ``MD`` (the markdown report lines) and ``FAILURES`` (checks that failed) and
appends to them; ``table`` prints a table and adds it to the report; ``@section`` runs one part
of a benchmark and turns an exception into a reported failure, so one broken part does not
lose the rest of a (costly) GPU run.
"""

from __future__ import annotations

import functools
import os
import time
import traceback

FAILURES: list[str] = []
MD: list[str] = []


def log(msg=""):
    print(msg, flush=True)


def code_version() -> str:
    """The commit a run measured: ``$INFERSCALE_COMMIT`` (set it where the tree travels without .git, as
    on the device machine), else the checkout's short commit (``git rev-parse``), marked ``+changes`` when
    files outside ``bench/results/`` differ from it; ``unknown`` without either."""
    env = os.environ.get("INFERSCALE_COMMIT")
    if env:
        return env
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", ".", ":!bench/results"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" +changes" if dirty else "")


def write_md(out_dir, name, lines):
    """Write the report ``lines`` to ``out_dir/name``; return the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    log(f"\nwrote {path}")
    return path


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend, or None (logged) when not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - plots are optional
        log(f"no plot: matplotlib unavailable ({e!r})")
        return None
    return plt


def step_axes(results, width: float, height: float):
    """One panel per step for a benchmark's ``results`` (rows whose first item names their step, in order):
    (figure, [(axis, step), ...]), or (None, []) without matplotlib or results."""
    plt = pyplot() if results else None
    if plt is None:
        return None, []
    steps = list(dict.fromkeys(r[0] for r in results))
    fig, axes = plt.subplots(1, len(steps), figsize=(width * len(steps), height), squeeze=False)
    return fig, list(zip(axes[0], steps))


def plot_forms_by_rows(results, out_dir: str, name: str, xlabel: str, ratio) -> None:
    """One panel per case of ``results`` rows ``(case, rows, form, ...)``: each form's ``ratio(row)`` (e.g. device
    time over the floor) against the row count on a log2 axis; written to ``out_dir/name`` when matplotlib is there."""
    fig, panels = step_axes(results, 5, 4)
    if fig is None:
        return
    for ax, case in panels:
        rows = [r for r in results if r[0] == case]
        for form in dict.fromkeys(r[2] for r in rows):
            pts = [(r[1], ratio(r)) for r in rows if r[2] == form]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=form)
        ax.set_xscale("log", base=2)
        ax.set_title(case)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("device time / floor")
        ax.legend(fontsize=6)
    save_plot(fig, out_dir, name)


def log_timed(label: str, t: float, t_dev: float, floor: float, kernels, width: int = 40, top: int = 4) -> None:
    """Log one timed form of a kernel bench: its host and device time per call, its floor (seconds) and its top
    ``kernels`` (the device rows of ``kernels.time_calls_and_device``: name, us per call)."""
    tops = ", ".join(f"{r[1][:width]} {r[2]:.1f}" for r in kernels[:top])
    log(f"  {label}: {t * 1e6:.1f} us, device {t_dev * 1e6:.1f} us, floor {floor * 1e6:.1f} ({tops})")


def table(title, headers, rows, md=True):
    """Print a right-aligned table; add it to the markdown report unless ``md`` is False."""
    log(f"\n## {title}")
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    log("  ".join(str(h).rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        log("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    if md:
        MD.extend([f"## {title}", "", "| " + " | ".join(map(str, headers)) + " |",
                   "|" + "---|" * len(headers)])
        MD.extend("| " + " | ".join(map(str, r)) + " |" for r in rows)
        MD.append("")


def switch_lines() -> list[str]:
    """A header line naming the ``INFERSCALE_*`` switches set in the environment (A/B runs set them outside the
    command line), none when unset or empty (empty: the default); the commit, the cache folder and the
    clients' venv are named elsewhere or nowhere."""
    skip = ("INFERSCALE_COMMIT", "INFERSCALE_CACHE", "INFERSCALE_CLIENTS_VENV")  # (not switches)
    found = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("INFERSCALE_") and k not in skip and v)
    return [f"- switches: {', '.join(f'`{x}`' for x in found)}"] if found else []


def finish(out_dir: str, name: str, title: str, t0: float, root: str, extra: list[str] = ()) -> None:
    """Write the report ``name``: a header (title, date, device, the command as typed, total time,
    ``extra`` lines, failures) then ``MD``; exit non-zero when a check failed."""
    import datetime
    import shlex
    import sys

    import jax

    dev = jax.devices()[0]
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], root)] + sys.argv[1:])
    head = [f"# {title}", "", f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- devices: {jax.device_count()} x {dev.device_kind} ({dev.platform}), jax {jax.__version__}",
            f"- command: `python {cmd}`", f"- code: {code_version()}",
            f"- total time: {time.time() - t0:.0f} s", *switch_lines(), *extra, ""]
    if FAILURES:
        head += ["**FAILURES:**", ""] + [f"- {f}" for f in FAILURES] + [""]
    write_md(out_dir, name, head + MD)
    if FAILURES:
        sys.exit(1)


def section(fn):
    """Run one section; print its traceback instead of stopping the script."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        log(f"\n==== {fn.__name__} ====")
        t0 = time.time()
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - report and go on
            tb = traceback.format_exc()
            log(tb)
            FAILURES.append(f"{fn.__name__}: {tb.strip().splitlines()[-1]}")
            MD.extend([f"## {fn.__name__}: FAILED", "", "```", tb, "```", ""])
        log(f"({fn.__name__}: {time.time() - t0:.0f} s)")
    return run


def save_plot(fig, out_dir: str, name: str) -> str:
    """Lay out ``fig``, write it to ``out_dir/name`` (PNG, 120 dpi); return the path."""
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")
    return path
