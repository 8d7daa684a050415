"""XLA compiler options of the engine's step executables.

XLA lowers each of a step's matmuls itself: a Triton GEMM with autotuned tiles (split-K for few
rows) or a cuBLAS call, whichever its autotuner times faster among the tiles it tries.  The
graph-mode profiles of the 8B's steps (bench/NOTES.md, run AQ) read the same 16 GB of weights at
1.05x the read floor with one row and 1.19x with 64, so the choice is worth an A/B switch:
``INFERSCALE_GEMM`` names one of ``GEMM_CHOICES``, passed to every step executable's compile as
``compiler_options`` (per executable, so nothing else in the process changes):

- ``default`` (or unset): XLA's own choice;
- ``exhaustive``: ``xla_gpu_exhaustive_tiling_search`` (the autotuner tries every Triton tile: a
  longer compile, kept by the executable store and JAX's compilation cache);
- ``cublas``: ``xla_gpu_enable_triton_gemm`` off (cuBLAS for every GEMM).

The options only act on GPUs (on the CPU, where the tests run, XLA accepts and ignores them).
``bench/kernels/gemm_flags.py`` times the model's matmul shapes under the same choices.  Run AQ (H100,
bench/NOTES.md): a step's matmuls with cuBLAS alone take longer at 1, 64 and 256 rows (its one-row
GEMV ~4x per matmul; only down at 64 rows was slightly faster), and the exhaustive search spent ~20 s
autotuning each GEMM shape and finished 5 of 15 points, mixed (qkv -1 to -16%, o -6 / +10%), so
``default`` stays the default until a run at 64 rows says otherwise (rerun_h200.sh part 22).
"""

from __future__ import annotations

from pallas_kernels.common import env_choice

GEMM_CHOICES = {
    "default": {},
    "exhaustive": {"xla_gpu_exhaustive_tiling_search": True},
    "cublas": {"xla_gpu_enable_triton_gemm": False},
}


def gemm_choice() -> str:
    """``INFERSCALE_GEMM``'s choice (``default`` when unset); a clear error for any other value."""
    return env_choice("INFERSCALE_GEMM", GEMM_CHOICES)  # ("default", XLA's own choice, first)


def step_compiler_options() -> dict | None:
    """The compiler options of a step executable (None: XLA's defaults)."""
    return dict(GEMM_CHOICES[gemm_choice()]) or None
