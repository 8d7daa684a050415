"""Section a of ``bench/engine/engine_bench.py``: this device's ceilings, measured in the same run as the rest.

- copy bandwidth: the faster of a donated ``x = x + c`` (one XLA fusion) and a device memcpy over
  1 GiB of bf16, bytes = read + written, median of chains of 10 steps with one sync each (the host
  round trip stays out); ``bench/kernels/kernels.py`` measures it the same way;
- read-only bandwidth: a float32-accumulating sum over 2 GiB (``common.read_bandwidth``): the
  ceiling of a step that reads weights and KV and writes almost nothing;
- matmul ceiling: a bf16 8192^3 matmul chain (``common.matmul_ceiling``), beside the 989 TFLOP/s
  dense bf16 peak of the H200's datasheet.

Read-bound floors use the larger of the two bandwidths (``EngineBench.bandwidth``); compute floors
the measured matmul ceiling.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from common import H200_BF16_PEAK, EngineBench, matmul_ceiling, median, read_bandwidth  # bench/lib/common.py
from report import MD, section, table  # bench/lib/report.py


@section
def bandwidth(b: EngineBench):
    n = (16 if b.quick else 1024) * 2**20 // 2
    x = jax.random.normal(jax.random.PRNGKey(7), (n,), jnp.bfloat16)
    c = jnp.asarray(0.5, jnp.bfloat16)
    add = jax.jit(lambda a, k: a + k, donate_argnums=0)
    cp = jax.jit(lambda a: jax.lax.optimization_barrier(a).copy())
    box = [x]
    steps = {"x = x + c (donated)": lambda: box.__setitem__(0, add(box[0], c)),
             "copy": lambda: box.__setitem__(0, cp(box[0]))}
    rows, bws = [], []
    for name, step in steps.items():
        for _ in range(3):  # compile + warm up
            step()
        jax.block_until_ready(box[0])
        times, chain = [], 10
        for _ in range(5 if b.quick else 15):
            t0 = time.perf_counter()
            for _ in range(chain):
                step()
            jax.block_until_ready(box[0])
            times.append((time.perf_counter() - t0) / chain)
        t = median(times)
        nbytes = 2 * box[0].nbytes
        bws.append(nbytes / t)
        rows.append([name, f"{nbytes / 2**30:.2f} GiB", f"{t * 1e6:.0f}", f"{min(times) * 1e6:.0f}",
                     f"{bws[-1] / 1e9:.0f} GB/s"])
    b.copy_bw = max(bws)
    box.clear()
    read_bytes = (64 << 20) if b.quick else (2 << 30)
    b.read_bw = read_bandwidth(read_bytes)
    rows.append(["sum (read only, float32 accumulate)", f"{read_bytes / 2**30:.2f} GiB", "", "",
                 f"{b.read_bw / 1e9:.0f} GB/s"])
    n_mm = 256 if b.quick else 8192
    b.mm_flops = matmul_ceiling(n_mm)
    rows.append([f"bf16 matmul {n_mm}^3 (float32 accumulate)", "", "", "",
                 f"{b.mm_flops / 1e12:.0f} TFLOP/s ({b.mm_flops / H200_BF16_PEAK:.0%} of the 989 peak)"])
    table("a. Device ceilings (copies: read + written bytes; the sum: read bytes)",
          ["op", "bytes/step", "median us", "min us", "rate"], rows)
    MD.extend([f"Read-bound floors use the larger of the read-only and copy figures, {b.bandwidth() / 1e9:.0f} GB/s "
               f"(the hardest floor this run supports); compute floors the measured matmul ceiling, "
               f"{b.mm_flops / 1e12:.0f} TFLOP/s.", ""])
