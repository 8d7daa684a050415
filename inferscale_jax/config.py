"""``EngineConfig``: the engine's settings (docs/architecture.md), validated on construction."""

from __future__ import annotations

import dataclasses
import os

DTYPES = ("bfloat16", "float32", "float16")
ATTENTION_IMPLS = ("auto", "pallas", "pallas_tpu", "ref")
QUANTIZED_KV_DTYPES = ("int8", "float8_e4m3fn")
MATMUL_PRECISIONS = ("default", "high", "highest")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    hbm_pages: int | None = None  # None: hbm_fraction of the memory the weights leave (a multiple of 512 pages)
    dtype: str = "bfloat16"
    # the KV pages' dtype: None = the model's dtype; "int8" / "float8_e4m3fn" store compressed KV with a
    # float32 scale per (token, kv head), twice the tokens per byte (pallas_kernels/quant.py)
    kv_dtype: str | None = None
    snapshot_dir: str | None = None
    # sequences per device step; None: from the machine (256 on a GPU/TPU, 64 on the CPU, fewer when
    # the page pool holds less than 1024 tokens per sequence: Engine.max_batch)
    max_batch: int | None = None
    # rows of max_batch no single tenant may hold, as a fraction (at least one row when > 0): kept for the
    # other tenants, so a request arriving while another tenant floods starts at the next step
    # (scheduler.py, Admit); 0: none (`serve` sets 1/8 when its key file names several non-admin tenants)
    tenant_reserve: float = 0.0
    prefill_chunk: int = 512  # new tokens per sequence per step at most (chunked prefill)
    # new tokens per device step, prefill chunks and decode rows together (vLLM's
    # max_num_batched_tokens); None: max(max_batch, 4 x prefill_chunk)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    hbm_fraction: float = 0.85  # of the device memory the weights leave, given to the page pool when hbm_pages is None
    # "pallas" GPU kernels (GPU default), "pallas_tpu" TPU kernels (TPU default; interpret mode elsewhere),
    # "ref" jnp (CPU default); "auto" picks by jax.default_backend() (inferscale_jax/kv_cache.py)
    attention_impl: str = "auto"
    # matmul precision of the model's dots: "default" (bf16 inputs; TF32 for fp32 on a GPU),
    # "high" or "highest"; None: "highest" for float32 engines (a user picking fp32 wants it exact)
    matmul_precision: str | None = None
    # decode rows that share leading pages (one segment chain, or prefix-cache hits) read them once
    # per batch (the cascade kernel; its gain by rows: bench/NOTES.md, "Cascade (shared-prefix) decode")
    cascade_decode: bool = True
    # dispatch each step before reading the previous one's tokens (they feed it on the
    # device), so host work overlaps device work; the same tokens either way (logprobs up to the
    # rounding of a different batch shape: an ignored row can change a step's bucket)
    overlap_decode: bool = True
    # multi-step decode (decode_loop.py; vLLM's num_scheduler_steps): a step of decode rows only (no
    # prefill chunk or request waiting, no row needing the host per token: penalties, bias, grammar)
    # runs this many decode steps in one device loop, stop checks on the device; 1: every step alone
    decode_steps: int = 1
    prefix_caching: bool = True  # automatic prefix caching of full pages (segments work either way)
    blend_ratio: float = 0.15  # blend mode: fraction of segment tokens (2..n) recomputed
    min_table_pages: int = 4  # page-table width bucket floor: larger = fewer compiles, more bytes per step
    # tiers and persistence (tiers.py, snapshot.py, registry.py)
    host_pages: int | None = None  # pinned-host tier capacity in pages; None: 4x the HBM pool, <= 1/4 of RAM
    disk_pages: int | None = None  # disk tier capacity in pages; None: unbounded; past it KV is recomputed
    disk_dir: str | None = None  # disk tier folder (a cache); None: <snapshot_dir>/disk_tier or a temp folder
    # JAX's persistent compilation cache (compiled step executables on disk): a restart loads them
    # instead of compiling again; None: <$INFERSCALE_CACHE or ~/.cache/inferscale>/jax-compile
    compilation_cache: bool = True
    compilation_cache_dir: str | None = None
    snapshot_interval_s: float | None = None  # periodic snapshots (when segments changed); None: only
    #   save_snapshot() and close()
    strict_restore: bool = False  # a snapshot of another model/dtype/page size: raise (True) or log, start empty
    # the registry lost acknowledged writes that neither its journal nor the newest snapshot can redo, or
    # its file fails its check: refuse to start (False) naming them, or rebuild what can be rebuilt and
    # report the rest as lost, by id (True; `serve --repair`; recovery.py)
    repair_registry: bool = False
    # tensor parallelism (sharding.py): weights Megatron-style and the KV pool (on kv heads) split over
    # this many devices of one mesh; it must divide the model's heads and MLP width, and divide its kv
    # heads or be a multiple of them (kv heads replicated)
    tensor_parallel: int = 1
    # conversation memory (sessions.py): a session expires this long after its last turn, and a tenant
    # keeps at most this many (saving one more deletes its least recently used)
    session_ttl_s: float = 3600.0
    max_sessions_per_tenant: int = 100

    def __post_init__(self):
        # folders are absolute from here on: orbax refuses relative paths, and a later chdir must
        # not move the snapshots ("~" is expanded too, as a shell would)
        for field in ("snapshot_dir", "disk_dir", "compilation_cache_dir"):
            value = getattr(self, field)
            if value:
                object.__setattr__(self, field, os.path.abspath(os.path.expanduser(value)))

        def bad(field, value, allowed):
            raise ValueError(f"EngineConfig.{field}={value!r} is invalid: {allowed}")

        if self.page_size not in (8, 16, 32, 64):
            bad("page_size", self.page_size, "must be one of 8, 16, 32, 64")
        if self.hbm_pages is not None and self.hbm_pages < 2:
            bad("hbm_pages", self.hbm_pages, "must be >= 2 (page 0 is the reserved null page) or None")
        if self.dtype not in DTYPES:
            bad("dtype", self.dtype, f"must be one of {DTYPES}")
        if self.kv_dtype not in (None, self.dtype, *QUANTIZED_KV_DTYPES):
            bad("kv_dtype", self.kv_dtype, f"must be None (the model's dtype, {self.dtype}) or one of "
                f"{QUANTIZED_KV_DTYPES}")
        if not 0.0 <= self.tenant_reserve < 1.0:
            bad("tenant_reserve", self.tenant_reserve, "must be in [0, 1)")
        if self.max_batch is not None and self.max_batch < 1:
            bad("max_batch", self.max_batch, "must be >= 1 or None")
        if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
            bad("prefill_chunk", self.prefill_chunk, "must be a power of two >= 16")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < max(
                self.prefill_chunk, self.max_batch or 1):
            bad("max_num_batched_tokens", self.max_num_batched_tokens,
                f"must be >= prefill_chunk ({self.prefill_chunk}) and >= max_batch ({self.max_batch}), "
                "so one chunk and one decode token per row fit a step; or None")
        if not 0.0 < self.hbm_fraction <= 0.95:
            bad("hbm_fraction", self.hbm_fraction, "must be in (0, 0.95]")
        if not 0.0 <= self.blend_ratio <= 1.0:
            bad("blend_ratio", self.blend_ratio, "must be in [0, 1]")
        if self.min_table_pages < 1:
            bad("min_table_pages", self.min_table_pages, "must be >= 1")
        if self.matmul_precision not in (None, *MATMUL_PRECISIONS):
            bad("matmul_precision", self.matmul_precision, f"must be one of {MATMUL_PRECISIONS} or None")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            bad("tensor_parallel", self.tensor_parallel, "must be an integer >= 1 (devices of the mesh)")
        if not isinstance(self.decode_steps, int) or not 1 <= self.decode_steps <= 64:
            bad("decode_steps", self.decode_steps, "must be an integer in [1, 64] (1: no decode loop)")
        if not self.session_ttl_s > 0:
            bad("session_ttl_s", self.session_ttl_s, "must be > 0 seconds")
        if not isinstance(self.max_sessions_per_tenant, int) or self.max_sessions_per_tenant < 1:
            bad("max_sessions_per_tenant", self.max_sessions_per_tenant, "must be an integer >= 1")
        if self.attention_impl not in ATTENTION_IMPLS:
            bad("attention_impl", self.attention_impl, f"must be one of {ATTENTION_IMPLS}")
        if self.host_pages is not None and self.host_pages < 0:
            bad("host_pages", self.host_pages, "must be >= 0 or None")
        if self.disk_pages is not None and self.disk_pages < 0:
            bad("disk_pages", self.disk_pages, "must be >= 0 or None")
        if self.snapshot_interval_s is not None and not self.snapshot_interval_s > 0:
            bad("snapshot_interval_s", self.snapshot_interval_s, "must be > 0 or None")
        if self.snapshot_interval_s is not None and not self.snapshot_dir:
            bad("snapshot_interval_s", self.snapshot_interval_s, "needs snapshot_dir to be set")

    @property
    def quantized_kv(self) -> bool:
        return self.kv_dtype in QUANTIZED_KV_DTYPES

    @property
    def storage_label(self) -> str:
        """The dtype snapshots record and compare: the model's, plus the KV's when it is compressed."""
        return f"{self.dtype}/kv={self.kv_dtype}" if self.quantized_kv else self.dtype

    @property
    def resolved_matmul_precision(self) -> str:
        """``matmul_precision``, with None resolved: "highest" for float32, else "default"."""
        if self.matmul_precision is not None:
            return self.matmul_precision
        return "highest" if self.dtype == "float32" else "default"


def resolve_dtype(name: str) -> str:
    """``auto`` -> bfloat16 on a GPU or TPU, float32 on the CPU; any other name unchanged."""
    if name != "auto":
        return name
    import jax

    return "bfloat16" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "float32"
