"""Device-side kernel times from a JAX profiler trace (no TensorBoard needed).

``kernel_times(run, calls)`` runs ``run()`` (which must block) under ``jax.profiler.trace``,
reads the trace back with ``jax.profiler.ProfileData`` and sums the duration of every event on
the GPU planes' stream lines by name, divided by ``calls`` (the number of calls ``run`` makes of
the thing being profiled).  Host-clock timings include dispatch; these do not, so together they
say whether a small kernel is slow or merely launched from Python.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax


def kernel_times(run, calls: int, top: int = 12) -> list[tuple[str, str, float, float]]:
    """[(line, kernel name, us per call, events per call)], largest first; [] off the GPU."""
    from jax.profiler import ProfileData
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return []
        data = ProfileData.from_file(paths[0])
    total = collections.defaultdict(float)
    count = collections.Counter()
    lines = [ln for pl in data.planes if pl.name.startswith("/device:GPU") for ln in pl.lines]
    streams = [ln for ln in lines if ln.name.lower().startswith("stream")]
    # "XLA Ops" / "XLA Modules" lines repeat the streams' time grouped differently: streams only,
    # unless this jax names them otherwise (then every line, tagged with its name)
    for line in streams or lines:
        for ev in line.events:
            key = ("stream" if streams else line.name, ev.name[:90])
            total[key] += ev.duration_ns
            count[key] += 1
    rows = [(k[0], k[1], total[k] / 1e3 / calls, count[k] / calls) for k in total]
    rows.sort(key=lambda r: -r[2])
    return rows[:top]
