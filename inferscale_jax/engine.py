"""The ``Engine``: segments, exact KV injection, prefix caching and generation over paged KV.

The engine is the public API (``register_segment``, ``submit``, ``step``, ``generate``,
``stats``) over parts that each hold only the collaborators they need, none of them the engine:

- ``runner.py`` (``ModelRunner``): the device - the page pool's arrays, the compiled step
  buckets (``warmup``), the copy / splice kernels; ``fault`` once the device failed.
- ``kv_manager.py`` (``KVManager``): who holds which page - the page pool, the prefix cache,
  the segment store (segments and chain nodes), the tiers below HBM (``tiers.py``); admission's
  chain walk, page preparation, allocation with eviction, computing registered segments.
- ``scheduler.py`` (``Scheduler``): what runs when - admission, node jobs, the plan of one
  device step per iteration (decode rows and prefill chunks), preemption, finishing; it holds
  the KV manager and the page tables, no runner.
- ``step_loop.py`` (``StepLoop``): the engine-core loop - schedule, dispatch to the runner,
  read the previous step back and apply it (the overlap), a lost step rolled back.
- ``snapshot.py`` (``Persistence``, with ``snapshot_dir``): the registry and snapshots; it
  holds the KV manager.

What a request goes through here:

1. **Submit** (``submit``): resolve each named segment in the tenant's namespace (then the
   public one); an unknown or foreign id is ``SegmentNotFound``.  Check lengths against the
   model and the pool (``RequestTooLong``) and the sampling parameters (``ValueError`` naming
   the field).  The request is queued for the scheduler.
2. **Admission, chain nodes and pages** (``KVManager.start``, from the scheduler): the chain
   walk, node jobs for missing chain nodes, prefix-cache hits, copy-on-write of a shared
   partial page, fresh pages for the rest (``kv_manager.py`` tells it step by step).
3. **Compute** (``StepLoop.step``): prefill chunks and decode rows of all running requests in
   one device step; pages that fill enter the prefix cache.
4. **Release**: the request's page references and chain-node readers are dropped at finish.

Shared pages are never written: a request or node job writes only pages it allocated.
Registered segments are computed synchronously (``KVManager.materialize``,
``register_segments_batch``); chain nodes never are.
"""
from __future__ import annotations

import concurrent.futures
import functools
import gc
import hashlib
import logging
import time
from collections import Counter

import jax
import jax.numpy as jnp

from inferscale_jax import compile_cache, scoring, sharding
from inferscale_jax.config import EngineConfig
from inferscale_jax.errors import EngineFault, PoolExhausted, RequestTooLong
from inferscale_jax.exe_store import ExecutableStore, Preload, execution_devices, exe_store_wanted, start_key
from inferscale_jax.exe_store import fingerprint as exe_fingerprint
from inferscale_jax.kv_cache import PagedKVCache, page_bytes
from inferscale_jax.kv_manager import KVManager, Seq
from inferscale_jax.outputs import GenerationOutput, PromptScores
from inferscale_jax.runner import ModelRunner, StepRow, freeze_heap
from inferscale_jax.sampling import SamplingParams, request_key, tokenize_bad_words
from inferscale_jax.structured import GrammarCompiler
from inferscale_jax.request import Request, RequestOutput
from inferscale_jax.scheduler import Scheduler
from inferscale_jax.step_loop import StepLoop
from inferscale_jax import sessions
from inferscale_jax.segment_updates import VersionResult, next_version
from inferscale_jax.sessions import SessionInfo
from inferscale_jax.segments import ChainNode, Segment, SegmentInfo, check_segment_id, check_tenant, literal
from inferscale_jax.snapshot import Persistence
from inferscale_jax.tokenizer import decode_ids, encode_text
from models import ModelConfig, inv_freq
from models.loader import config_digest, load_params, load_params_sharded, weights_digest

log = logging.getLogger("inferscale.engine")
MODES = ("exact", "compose", "blend")
AUTO_PAGES_QUANTUM = 512  # auto-sized pools are a multiple of this many pages (_auto_pages)
ALLOCATOR_SLACK = 4 << 30  # device bytes in use beyond the weights that _auto_pages ignores, at most
FIRST_RUNS = ("now", "idle")  # Engine.warmup's first_runs (serve --first-runs)


def check_first_runs(first_runs: str) -> None:
    """Refuse a ``first_runs`` that is not one of ``FIRST_RUNS``, by name."""
    if first_runs not in FIRST_RUNS:
        raise ValueError(f"first_runs={first_runs!r} is invalid: must be one of {FIRST_RUNS}")


class Engine:
    # whether ``warmup(first_runs="idle")`` may leave the buckets' first runs to ``warm_idle``
    # (a process of a lockstep engine may not run a step the others do not: distributed.py)
    IDLE_WARM = True
    # ``warm_idle`` runs a first run only this long after the last step: a bucket's first run
    # takes ~0.1 s on a GPU, and a closed loop's next request (a client answering at once) must
    # not wait behind one (run AO: C = 1 TTFT 65 ms over HTTP against 12 ms in-process)
    IDLE_QUIET_S = 0.5
    _stepped_at = float("-inf")  # time.monotonic() of the last ``step``

    def __init__(self, params: dict, cfg: ModelConfig, tokenizer=None, config: EngineConfig | None = None,
                 fingerprint: str | None = None, placed: tuple | None = None, preload: Preload | None = None):
        """``placed``: ``(mesh, layout_cfg)`` when ``params`` are already in the tensor-parallel layout
        on that mesh (``models.load_params_sharded``, as ``from_pretrained`` loads them); else the
        engine shards them itself when ``config.tensor_parallel > 1``.  ``preload``: the executable
        store's entries ``from_pretrained`` began loading beside the weights (``exe_store.Preload``)."""
        self.config = config = config or EngineConfig()
        self.cfg, self.params, self.tokenizer = cfg, params, tokenizer
        self._grammars: GrammarCompiler | None = None
        self.dtype = jnp.dtype(config.dtype)
        s = config.page_size
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        # model fingerprint = config + weights digest (given by from_pretrained) + dtype + page size
        base = fingerprint or f"{config_digest(cfg)}|unnamed-weights"
        kv_tag = f"|kv={config.kv_dtype}" if config.quantized_kv else ""  # compressed KV: other bytes
        self.fingerprint = hashlib.sha256(f"{base}|{config.dtype}|{s}{kv_tag}".encode()).hexdigest()
        self.model_fingerprint = hashlib.sha256(base.encode()).hexdigest()  # the part SnapshotMismatch names
        num_pages = config.hbm_pages or self._auto_pages()
        impl = config.attention_impl  # "auto" resolved by the cache (kv_cache.resolve_impl: by backend)
        self.compilation_cache_dir = (compile_cache.enable(config.compilation_cache_dir)
                                      if config.compilation_cache else None)
        # tensor parallelism (sharding.py): the weights in the sharded layout, placed on the mesh; the
        # runner's model config says so (ModelConfig.fused_shards), the engine's stays as loaded
        self.mesh, run_cfg = None, cfg
        if placed is not None:
            self.mesh, run_cfg = placed
        elif config.tensor_parallel > 1:
            sharding.check_tensor_parallel(cfg, config.tensor_parallel, len(jax.devices()))
            self.mesh = sharding.make_mesh(config.tensor_parallel)
            run_cfg, self.params = sharding.shard_params(cfg, params, self.mesh)
        cache = PagedKVCache.create(run_cfg, num_pages, s, self.dtype, impl, mesh=self.mesh,  # (its kv heads)
                                    kv_dtype=config.kv_dtype)
        self.max_batch = config.max_batch or self._auto_max_batch(num_pages)
        budget = config.max_num_batched_tokens or max(self.max_batch, 4 * config.prefill_chunk)
        if budget < self.max_batch:
            raise ValueError(f"EngineConfig.max_num_batched_tokens={budget} is invalid: must be >= max_batch "
                             f"({self.max_batch}), so every running sequence's decode token fits a step")
        self.runner = ModelRunner(self.params, run_cfg, cache, max_batch=self.max_batch,
                                  prefill_chunk=config.prefill_chunk, max_num_batched_tokens=budget,
                                  max_pages_per_seq=-(-self.max_model_len // s),
                                  inv_freq=inv_freq(cfg.rope, cfg.head_dim),
                                  min_table_pages=config.min_table_pages,
                                  matmul_precision=config.resolved_matmul_precision)
        if self.compilation_cache_dir is not None and exe_store_wanted(self.runner.device.platform):
            # compiled steps by bucket, opt-in (exe_store.py: slower than tracing on the H200)
            self.runner.exe_store = ExecutableStore(self.compilation_cache_dir, exe_fingerprint(
                self.runner.params, cache, run_cfg, sorted(cache.k[0].sharding.device_set, key=lambda d: d.id)),
                preload=preload, devices=execution_devices(self.mesh, self.runner.device))
        elif preload is not None:
            preload.cancel()  # (no store after all: the early loads are dropped)
        self.bos_prefix: list[int] = []
        if tokenizer is not None and getattr(tokenizer, "bos_token_id", None) is not None:
            if tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]:
                self.bos_prefix = [tokenizer.bos_token_id]
        self._counters = dict(requests=0, prompt_tokens=0, cached_tokens=0, generated_tokens=0,
                              segment_tokens_computed=0)
        # the parts, each holding only the collaborators it needs (docs/architecture.md): pages,
        # store, prefix cache and tiers (kv_manager.py); the schedule (scheduler.py); persistence
        self.kv = KVManager(config, cfg, self.runner, self.dtype, num_pages=num_pages,
                            fingerprint=self.fingerprint, bos_prefix=self.bos_prefix)
        self.pool, self.prefix_cache, self.store, self.tiers = (self.kv.pool, self.kv.prefix_cache, self.kv.store,
                                                                self.kv.tiers)
        self.persistence = Persistence(self.kv, self.model_fingerprint) if config.snapshot_dir else None
        self.scheduler = Scheduler(self.kv, self.runner.tables, config=config, cfg=cfg, max_batch=self.max_batch,
                                   max_tokens=self.runner.max_tokens,
                                   decode=functools.partial(decode_ids, tokenizer), counters=self._counters,
                                   token_buckets=self.runner.buckets.token_buckets)
        self.loop = StepLoop(self.scheduler, self.runner, self.kv, overlap=config.overlap_decode)
        if self.persistence is not None:
            self.persistence.restore()  # last: restore may compute segments on the finished engine
        freeze_heap()  # the long-lived heap out of the cyclic GC's walks (runner.freeze_heap)

    @classmethod
    def from_pretrained(cls, model_dir: str | None = None, config: EngineConfig | None = None) -> "Engine":
        """Load an HF checkpoint folder (default: the embedded default model)."""
        from inferscale_jax.default_model import default_model_dir

        config = config or EngineConfig()
        model_dir = model_dir or default_model_dir()
        cfg = ModelConfig.from_pretrained(model_dir)
        preload = None
        t0 = time.perf_counter()
        if config.compilation_cache:  # before the load: its placing ops' compiles are cached too
            cache_dir = compile_cache.enable(config.compilation_cache_dir)
            if cache_dir is not None and exe_store_wanted(jax.devices()[0].platform):
                # the store's entries the last such start used load beside the weights (exe_store.py)
                try:
                    tp = config.tensor_parallel  # (the devices the engine will place its steps on, as _load does)
                    preload = Preload(cache_dir, start_key(model_dir, cfg, config, jax.devices()),
                                      devices=execution_devices(sharding.make_mesh(tp) if tp > 1 else None,
                                                                jnp.zeros(()).devices().pop()))
                except OSError as err:  # (a file of the folder that cannot be read: the load says which)
                    log.debug("no early store loads: %s", err)
        try:
            return cls._load(model_dir, cfg, config, t0, preload)
        except BaseException:
            if preload is not None:
                preload.cancel()  # (the early loads stop with the start)
            raise

    @classmethod
    def _load(cls, model_dir: str, cfg: ModelConfig, config: EngineConfig, t0: float,
              preload: Preload | None) -> "Engine":
        """``from_pretrained``'s load: the weights, beside them the tokenizer and the weights'
        digest; then the engine."""
        from inferscale_jax.tokenizer import load_tokenizer

        placed = None

        def side() -> tuple:  # the tokenizer and the weights' digest, on a thread beside the weights
            try:
                tok = load_tokenizer(model_dir)
            except ValueError as e:
                log.warning("%s; the engine accepts token ids only", e)
                tok = None
            t_mid = time.perf_counter()
            digest = weights_digest(model_dir)
            return tok, digest, t_mid - t0, time.perf_counter() - t_mid

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inferscale-tokenizer") as pool:
            tokenizer_future = pool.submit(side)
            if config.tensor_parallel > 1:  # each device reads only its slices (sharding.py)
                sharding.check_tensor_parallel(cfg, config.tensor_parallel, len(jax.devices()))
                mesh = sharding.make_mesh(config.tensor_parallel)
                layout_cfg, params = load_params_sharded(model_dir, cfg, mesh, jnp.dtype(config.dtype))
                placed = (mesh, layout_cfg)
            else:
                params = load_params(model_dir, cfg, jnp.dtype(config.dtype))
            tw = time.perf_counter()
            tokenizer, digest, t_tok, t_digest = tokenizer_future.result()
        fp = hashlib.sha256(f"{config_digest(cfg)}|{digest}".encode()).hexdigest()
        t1 = time.perf_counter()
        engine = cls(params, cfg, tokenizer, config, fingerprint=fp, placed=placed, preload=preload)
        log.info("loaded %s: weights and tokenizer in %.1f s (weights %.1f s, beside them the tokenizer %.1f s and "
                 "the weights' digest %.1f s), the engine (KV pool of %d pages, snapshot) in %.1f s", model_dir,
                 t1 - t0, tw - t0, t_tok, t_digest,
                 engine.runner.cache.num_pages, time.perf_counter() - t1)
        return engine

    @property
    def fault(self) -> EngineFault | None:
        """Set when the device failed (or page accounting broke): the engine serves no more."""
        return self.runner.fault

    @fault.setter
    def fault(self, value: EngineFault | None) -> None:
        self.runner.fault = value

    @property
    def debug_checks(self) -> bool:
        """Tests: check page accounting after every device step."""
        return self.kv.debug_checks

    @debug_checks.setter
    def debug_checks(self, on: bool) -> None:
        self.kv.debug_checks = on

    def _auto_max_batch(self, num_pages: int) -> int:
        """``EngineConfig.max_batch=None``: 256 sequences on a GPU/TPU, 64 on the CPU, fewer when
        the pool holds less than 1024 tokens per sequence (at least 8)."""
        default = 64 if jax.default_backend() == "cpu" else 256
        return max(1, min(default, max(8, (num_pages - 1) * self.config.page_size // 1024)))

    def _weights_bytes(self, device) -> int:
        """The weights' bytes on ``device`` (exact: the same at every start)."""
        return sum(shard.data.nbytes for x in jax.tree_util.tree_leaves(self.params)
                   for shard in getattr(x, "addressable_shards", ()) if shard.device == device)

    def _auto_pages(self) -> int:
        """``hbm_pages=None``: ``hbm_fraction`` of the device's free memory, rounded down to a
        multiple of ``AUTO_PAGES_QUANTUM`` pages.  The pool's size is part of every compiled
        step's shapes: free memory is the limit less the weights' exact bytes, and rounded, so a
        restart finds its steps in the persistent compilation cache and the executable store.  What
        the allocator reports in use beyond the weights right after the load (buffers the loader
        dropped but the allocator has not taken back, its chunk rounding) differs from one start to
        the next by hundreds of MB (bench/NOTES.md, run AL: 38400 then 38912 pages), so up to a
        slack it is not counted; more than that is another engine's pool in this process, and is."""
        # with tensor parallelism each device holds 1/N of every page's kv heads (one replica when the
        # model has fewer kv heads than N: sharding.py)
        tp, kv = self.config.tensor_parallel, self.cfg.num_kv_heads
        per_page = page_bytes(self.cfg, self.config.page_size, self.config.kv_dtype or self.dtype) * max(kv, tp) // kv // tp
        device = jax.local_devices()[0]
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            gc.collect()  # (cyclic garbage holding device buffers)
            stats = device.memory_stats() or stats
            limit = stats["bytes_limit"]
            weights = self._weights_bytes(device)
            # (at most half the headroom hbm_fraction leaves, so the uncounted bytes always fit in it)
            slack = min(ALLOCATOR_SLACK, int((limit - weights) * (1 - self.config.hbm_fraction) / 2))
            in_use = stats.get("bytes_in_use", 0)
            free = limit - (in_use if in_use > weights + slack else weights)
            n = int(free * self.config.hbm_fraction) // per_page
            return max(2, n // AUTO_PAGES_QUANTUM * AUTO_PAGES_QUANTUM if n >= 2 * AUTO_PAGES_QUANTUM else n)
        # host-only backends cannot donate buffers, so every step copies a layer's pool: keep it
        # small (64 MiB), but big enough for two sequences of the model's maximum length
        one_seq = -(-self.max_model_len // self.config.page_size)
        return max(2 * one_seq + 1, (64 << 20) // per_page)

    # -- tokens ---------------------------------------------------------------------------
    def _encode(self, text: str, field: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{field}: this model folder has no tokenizer; pass token ids instead")
        return encode_text(self.tokenizer, text)

    def _check_ids(self, ids, field: str) -> list[int]:
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{field} holds token id {bad[0]} outside [0, {self.cfg.vocab_size}) "
                             "(the model's vocab size)")
        return ids

    def _decode(self, ids: list[int]) -> str:
        return decode_ids(self.tokenizer, ids)

    # -- pages ----------------------------------------------------------------------------
    # -- segments -------------------------------------------------------------------------
    def register_segment(self, segment_id: str, text: str | None = None, token_ids=None, *,
                         tenant: str = "default", public: bool = False, pin: bool = False) -> SegmentInfo:
        """Compute a segment's KV once and keep it under ``segment_id`` in the tenant's namespace."""
        check_segment_id(segment_id)
        if (text is None) == (token_ids is None):
            raise ValueError("register_segment needs exactly one of text= or token_ids=")
        check_tenant(tenant)
        ids = self._encode(text, "text") if text is not None else self._check_ids(token_ids, "token_ids")
        if not ids:
            raise ValueError(f"segment {segment_id!r} is empty: give at least one token")
        return self._register(segment_id, ids, tenant, public=public, pin=pin)

    def _register(self, internal_id: str, ids: list[int], tenant: str, *, public: bool = False, pin: bool = False,
                  session: bool = False) -> SegmentInfo:
        """Compute and record a segment (or a session's first version: ``sessions.py``)."""
        ns = self.store.check_new(internal_id, tenant, public)
        self._check_fits(len(self.bos_prefix) + len(ids), f"segment {internal_id!r}")
        seq = self.kv.materialize(self.kv.root(ns), self.bos_prefix + ids, None)
        self._counters["segment_tokens_computed"] += len(seq.tokens) - seq.cached
        now = self.now()
        info = SegmentInfo(id=internal_id, tenant=tenant, num_tokens=len(ids), public=public, pin=pin,
                           created=now, updated=now if session else 0.0)
        seg = self.store.add(info, ids)
        self.store.add_node(ChainNode(ns, (seg.uid,), len(seq.tokens), seq.pages))
        if self.persistence is not None:
            self.persistence.on_registered(seg)  # durable (fsynced) before the acknowledgement
        return info

    def register_segments_batch(self, items, *, tenant: str = "default", public: bool = False, pin: bool = False,
                                step_tokens: int = 16384) -> list[SegmentInfo]:
        """``register_segment`` for many segments at once, their KV computed together (bulk
        precompute, ``precompute.py``).  ``items``: ``(segment_id, token_ids)`` pairs.

        1. Every item is checked as ``register_segment`` checks it (and ids must be distinct)
           before anything changes; a bad item raises and nothing is registered.
        2. Pages are prepared document by document, all-or-nothing each (``KVManager.prepare``).  When the
           pool cannot hold the next one, the documents already holding pages are computed and
           registered first (their roots can then be demoted to the host tier) and preparation
           resumes; ``PoolExhausted`` only when a document finds no pages with nothing pending
           (then the items before it stay registered).
        3. Each device step runs one chunk (``StepRow``, at most ``prefill_chunk`` tokens) of
           each of the unfinished documents with the most tokens left, up to ``max_batch`` rows
           and ``min(step_tokens, max_num_batched_tokens)`` tokens (the flat step has no per-row
           padding, so chunks of any length share a step; the budget bounds activation memory).
        4. Each document is registered exactly as ``register_segment`` does (prefix-cache pages,
           root chain node, durable registry row before returning) and its ``SegmentInfo`` returned."""
        check_tenant(tenant)
        if step_tokens < 16:
            raise ValueError(f"step_tokens={step_tokens} is invalid: must be >= 16 (the smallest chunk bucket)")
        docs, seen = [], set()
        for segment_id, token_ids in items:
            check_segment_id(segment_id)
            if segment_id in seen:
                raise ValueError(f"segment_id={segment_id!r} appears twice in one batch: give each id once")
            seen.add(segment_id)
            ids = self._check_ids(token_ids, f"token_ids of segment {segment_id!r}")
            if not ids:
                raise ValueError(f"segment {segment_id!r} is empty: give at least one token")
            ns = self.store.check_new(segment_id, tenant, public)
            self._check_fits(len(self.bos_prefix) + len(ids), f"segment {segment_id!r}")
            docs.append((segment_id, ids, ns))
        infos: list[SegmentInfo] = []
        chunk, max_rows = self.config.prefill_chunk, self.runner.max_batch
        budget = min(step_tokens, self.runner.max_tokens)
        while docs:
            seqs: list[Seq] = []
            done = 0  # seqs whose pages a registered root node owns
            try:
                for segment_id, ids, ns in docs:
                    try:
                        seqs.append(self.kv.prepare(self.kv.root(ns), self.bos_prefix + ids, None, want_logits=False))
                    except PoolExhausted:
                        if not seqs:
                            raise
                        break  # compute and register what holds pages, then go on
                live = [q for q in seqs if q.computed < len(q.tokens)]
                while live:
                    live.sort(key=lambda q: q.computed - len(q.tokens))  # most tokens left first
                    rows, used = [], 0
                    for q in live[:max_rows]:
                        take = min(chunk, len(q.tokens) - q.computed, budget - used)
                        if take <= 0:
                            break
                        rows.append(StepRow(q.tokens[q.computed:q.computed + take], q.computed, q.pages))
                        used += take
                    self.kv.step(rows, 0)
                    for q, row in zip(live, rows):
                        q.computed += len(row.tokens)
                    live = [q for q in live if q.computed < len(q.tokens)]
                for (segment_id, ids, ns), seq in zip(docs, seqs):
                    self.kv.register_full_pages(seq)
                    info = SegmentInfo(id=segment_id, tenant=tenant, num_tokens=len(ids), public=public, pin=pin,
                                       created=time.time())
                    seg = self.store.add(info, ids)
                    self.store.add_node(ChainNode(ns, (seg.uid,), len(seq.tokens), seq.pages))
                    done += 1  # the node owns the pages now (on_registered releases them if it fails)
                    if self.persistence is not None:
                        self.persistence.on_registered(seg)  # durable (fsynced) before the acknowledgement
                    infos.append(info)
            except BaseException:
                for seq in seqs[done:]:
                    self.pool.decref(reversed(seq.pages))
                raise
            docs = docs[len(seqs):]
        return infos

    def update_segment(self, segment_id: str, text: str | None = None, token_ids=None, *,
                       tenant: str = "default") -> SegmentInfo:
        """Replace a segment's content atomically; returns the new version's info (``version``
        one higher).  Requests already running keep reading the old version to their end; new
        ones see only the new version; the old version's chain nodes are never served again.
        Only tokens after the old and new versions' common prefix are computed
        (``segment_updates.py``).  Durable like ``register_segment``."""
        seg, ids = self._new_content(segment_id, text, token_ids, tenant, "update_segment")
        return self._next_version(seg, ids, promote=False).info

    def append_segment(self, segment_id: str, text: str | None = None, token_ids=None, *,
                       tenant: str = "default") -> SegmentInfo:
        """Append tokens to a segment: a new version whose KV is the old one's plus the appended
        tokens computed over it (cost proportional to the appended tokens).  The text is
        tokenized on its own and its ids appended, so the result equals registering the
        concatenated token ids.  Versioned and durable like ``update_segment``."""
        seg, ids = self._new_content(segment_id, text, token_ids, tenant, "append_segment")
        return self._next_version(seg, seg.token_ids + ids, promote=True).info

    def _new_content(self, segment_id, text, token_ids, tenant, what: str) -> tuple[Segment, list[int]]:
        check_segment_id(segment_id)
        if (text is None) == (token_ids is None):
            raise ValueError(f"{what} needs exactly one of text= or token_ids=")
        check_tenant(tenant)
        seg = self.store.owned(segment_id, tenant)
        ids = self._encode(text, "text") if text is not None else self._check_ids(token_ids, "token_ids")
        if not ids:
            raise ValueError(f"{what}({segment_id!r}): the new content is empty; give at least one token")
        return seg, ids

    def _next_version(self, seg: Segment, ids: list[int], promote: bool) -> VersionResult:
        self._check_fits(len(self.bos_prefix) + len(ids), f"segment {seg.info.id!r}")
        result = next_version(self.kv, self.persistence, seg, ids, promote=promote, now=self.now())
        self._counters["segment_tokens_computed"] += result.computed_tokens
        return result

    def list_segments(self, tenant: str = "default") -> list[SegmentInfo]:
        return self.store.visible(tenant)

    def delete_segment(self, segment_id: str, tenant: str = "default") -> None:
        """Forget a segment; its pages are freed once no running request reads them."""
        self._remove(self.store.owned(segment_id, tenant))

    def _remove(self, seg: Segment) -> None:
        """Forget a segment or session: durably, then its lower-tier copy and chain nodes."""
        if self.persistence is not None:
            self.persistence.on_deleted(seg)
        self.tiers.forget(seg.uid)
        for node in self.store.remove(seg):
            self.kv.release_node(node)

    # -- sessions (sessions.py) -------------------------------------------------------------
    def now(self) -> float:
        """Wall-clock time for session expiry (``LockstepEngine``: the leader's, in every process)."""
        return time.time()

    def save_session(self, session_id: str, text: str | None = None, token_ids=None, *, segments=(),
                     tenant: str = "default") -> SessionInfo:
        """Keep a conversation so far as the tenant's session ``session_id``: the tokens of
        ``segments`` (ids and literal token runs, as ``submit`` takes them) followed by ``text`` or
        ``token_ids`` (no BOS).  Each save is the session's next version, computed mostly from what
        the last turn left in pages.  A later ``submit(..., session=session_id)`` whose tokens
        start with it computes only the rest (``sessions.py``)."""
        sessions.check_session_id(session_id)
        if (text is None) == (token_ids is None):
            raise ValueError("save_session needs exactly one of text= or token_ids=")
        check_tenant(tenant)
        ids = self._encode(text, "text") if text is not None else self._check_ids(token_ids, "token_ids")
        ids = [t for item in segments for t in self._chain_element(item, tenant).token_ids] + ids
        if not ids:
            raise ValueError(f"session {session_id!r} is empty: give at least one token")
        return sessions.save(self, session_id, tenant, ids)

    def list_sessions(self, tenant: str = "default") -> list[SessionInfo]:
        check_tenant(tenant)
        return sessions.listing(self, tenant)

    def session_info(self, session_id: str, tenant: str = "default") -> SessionInfo:
        """``SegmentNotFound`` for an unknown or expired session (or another tenant's)."""
        check_tenant(tenant)
        return sessions.info(self, session_id, tenant)

    def delete_session(self, session_id: str, tenant: str = "default") -> None:
        check_tenant(tenant)
        sessions.delete(self, session_id, tenant)

    # -- generation -----------------------------------------------------------------------
    def submit(self, prompt: str | None = None, *, prompt_token_ids=None, segments=(),
               tenant: str = "default", sampling: SamplingParams | None = None, mode: str = "exact",
               request_id: str | None = None, session: str | None = None) -> str:
        """Validate and queue a request (``scheduler.py``, 1); returns its id.  ``session``: a
        conversation kept by ``save_session``; when its tokens begin this request's, its KV is
        injected as the first segment (``sessions.py``)."""
        t0 = time.perf_counter()
        if self.fault is not None:
            raise self.fault
        sampling = sampling or SamplingParams()
        sampling.validate(self.cfg.vocab_size)
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid: must be one of {MODES}")
        check_tenant(tenant)
        if prompt is not None and prompt_token_ids is not None:
            raise ValueError("give prompt= or prompt_token_ids=, not both")
        if isinstance(segments, str):
            raise ValueError("segments must be a list of segment ids, not a string")
        ids = (self._encode(prompt, "prompt") if prompt is not None
               else self._check_ids(prompt_token_ids or [], "prompt_token_ids"))
        if sampling.truncate_prompt_tokens is not None and len(ids) > sampling.truncate_prompt_tokens:
            ids = ids[-sampling.truncate_prompt_tokens:]  # the prompt's last k tokens (vLLM's rule)
        chain = [self._chain_element(item, tenant) for item in segments]
        if not ids and not chain:
            raise ValueError("prompt is empty and no segments are named: give at least one token")
        tokens = list(self.bos_prefix)
        for seg in chain:
            tokens += seg.token_ids  # (a list's extend: no Python loop over a segment's tokens)
        tokens += ids
        bad_words = (tokenize_bad_words(sampling.bad_words, lambda t: self._encode(t, "bad_words"))
                     if sampling.bad_words else [])
        if session is not None:
            hit = sessions.split(self, session, tenant, tokens[len(self.bos_prefix):])
            if hit is not None:  # [session] + the rest: the earlier turns' KV, exactly
                chain, mode = [hit], "exact"
        self._check_fits(len(tokens) + sampling.max_tokens, "request",
                         detail=f" ({len(tokens)} prompt + {sampling.max_tokens} max_tokens)")
        if mode != "exact" and len(chain) > 1:
            self._check_composed_fits(chain, len(tokens) + sampling.max_tokens)
        elif len(chain) > 1:
            self._check_chain_fits(chain, len(tokens), sampling.max_tokens)
        if request_id is not None and request_id in self.scheduler.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        self._counters["requests"] += 1
        rid = request_id or f"req-{self._counters['requests']}"
        key = request_key(sampling.seed)  # no seed: OS entropy, so processes never repeat a stream
        grammar = self.grammars.submit(sampling.structured_outputs) if sampling.structured_outputs else None
        req = Request(rid, tenant, tokens, chain, sampling, mode, key, arrival=t0, bad_words_ids=bad_words,
                      grammar=grammar)
        if sampling.prompt_logprobs is not None:
            req.prompt_logprobs = self._score(tokens, len(ids), sampling.prompt_logprobs)
            req.prompt_ids = ids
        self.scheduler.add(req)
        return rid

    def prompt_logprobs(self, prompt: str | None = None, *, prompt_token_ids=None, segments=(),
                        tenant: str = "default", num_logprobs: int = 0,
                        truncate_prompt_tokens: int | None = None) -> PromptScores:
        """The prompt's ids, each one's ``{token_id: logprob}`` given everything before it -
        segments included - with the top ``num_logprobs`` alternatives, and each one's rank
        (``scoring.py``, ``PromptScores``).  No generation; ``SamplingParams.prompt_logprobs``
        gives the same alongside a generation."""
        if self.fault is not None:
            raise self.fault
        SamplingParams(prompt_logprobs=num_logprobs).validate(self.cfg.vocab_size)
        check_tenant(tenant)
        if prompt is not None and prompt_token_ids is not None:
            raise ValueError("give prompt= or prompt_token_ids=, not both")
        ids = (self._encode(prompt, "prompt") if prompt is not None
               else self._check_ids(prompt_token_ids or [], "prompt_token_ids"))
        if truncate_prompt_tokens is not None and len(ids) > truncate_prompt_tokens:
            ids = ids[-truncate_prompt_tokens:]
        if not ids:
            raise ValueError("prompt is empty: prompt log-probs need at least one prompt token")
        chain = [self._chain_element(item, tenant) for item in segments]
        tokens = list(self.bos_prefix)
        for seg in chain:
            tokens += seg.token_ids  # (a list's extend: no Python loop over a segment's tokens)
        tokens += ids
        self._check_fits(len(tokens), "request", detail=f" ({len(tokens)} prompt tokens)")
        ranks: list = []
        return PromptScores(ids, self._score(tokens, len(ids), num_logprobs, ranks), ranks, len(tokens))

    def _score(self, tokens: list[int], num_prompt: int, top_n: int, ranks: list | None = None) -> list:
        if num_prompt == 0:
            return []
        if self.config.tensor_parallel > 1:
            raise ValueError("prompt log-probs (prompt_logprobs, echo with logprobs) run on one device: this "
                             "engine has tensor_parallel > 1; use an engine with tensor_parallel=1 for scoring")
        return scoring.prompt_logprobs(self.params, self.cfg, tokens, num_prompt, top_n, self.dtype,
                                       self.config.resolved_matmul_precision, ranks)

    def _chain_element(self, item, tenant: str) -> Segment:
        """A ``segments`` item: a segment id, or a list of token ids placed literally (a chat
        template's text around a segment placed inside a message: ``segments.literal``)."""
        if isinstance(item, str):
            return self.store.resolve(item, tenant)
        if isinstance(item, (list, tuple)) and item:
            return literal(self._check_ids(item, "segments (a literal token run)"), tenant)
        raise ValueError(f"segments holds {item!r}: each item is a segment id (str) or a non-empty list of "
                         "token ids placed literally")

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: admit, then one device step of decode rows and prefill chunks
        (``scheduler.py``, 3).

        Failures are contained: a request's own failure fails it alone (the scheduler isolates
        it); an unexpected error fails the requests running at that moment with ``EngineFault``,
        then the page accounting is checked and serving goes on; a lost device (or broken
        accounting) sets ``fault``, after which ``step`` and ``submit`` raise it."""
        if self.fault is not None:
            raise self.fault
        try:
            return self._step()
        finally:
            self._stepped_at = time.monotonic()  # (after it: a slow step, a compile, leaves no quiet behind it)

    def _step(self) -> list[RequestOutput]:
        """``step`` less its timestamp: the loop's step, an unexpected failure contained."""
        try:
            return self.loop.step()
        except EngineFault:
            raise
        except Exception as err:  # noqa: BLE001 - contained here: see the docstring
            log.error("engine step failed; failing the running requests", exc_info=err)
            self.runner.check_device(err)
            outs = self.scheduler.finished_in_step()  # requests the step finished before it failed
            outs += self.loop.fail_running(EngineFault(
                f"internal error in an engine step ({type(err).__name__}); the requests running at that "
                "moment failed and the engine keeps serving: retry the request"))
            try:
                self.check_page_accounting()
            except AssertionError as bad:
                self.fault = EngineFault(f"page accounting is broken after a failed step ({bad}); "
                                         "the engine stopped serving: restart it")
                raise self.fault from err
            return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and release its pages (no-op for unknown or finished ids)."""
        return self.scheduler.abort(request_id)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationOutput:
        """Run one request to completion (other queued requests are batched along)."""
        return self.generate_batch([dict(prompt=prompt, **kwargs)])[0]

    def generate_batch(self, requests: list[dict]) -> list[GenerationOutput]:
        """Submit every request (each a dict of ``generate``'s keyword arguments), run them
        continuously batched, and return their outputs in order."""
        ids = [self.submit(**r) for r in requests]
        wanted = set(ids)
        done: dict[str, GenerationOutput] = {}
        try:
            while len(done) < len(ids):
                for out in self.step():
                    if out.finished and out.request_id in wanted:
                        if out.error is not None:
                            raise out.error
                        done[out.request_id] = out.output
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.abort(rid)
            raise
        return [done[rid] for rid in ids]

    # -- checks and stats -----------------------------------------------------------------
    def _check_fits(self, total: int, what: str, detail: str = "") -> None:
        if total > self.max_model_len:
            raise RequestTooLong(
                f"{what} needs {total} tokens{detail} but the model's limit is {self.max_model_len} "
                "(max_position_embeddings); shorten it or lower max_tokens")
        cap = (self.pool.num_pages - 1) * self.config.page_size
        if total > cap:
            raise RequestTooLong(
                f"{what} needs {total} tokens{detail} but the KV page pool holds at most {cap} tokens "
                f"({self.pool.num_pages - 1} pages of {self.config.page_size}); raise hbm_pages or shorten it")

    def _check_composed_fits(self, chain: list[Segment], total: int) -> None:
        """compose / blend read every segment's own KV at once: the segments' pages and the
        request's must fit the pool together, or the request could never be admitted."""
        s, lb = self.config.page_size, len(self.bos_prefix)
        seg_pages = sum(-(-(lb + len(seg.token_ids)) // s) for seg in chain)
        own = -(-total // s) - (lb + len(chain[0].token_ids)) // s  # the first segment's full pages are shared
        cap = self.pool.num_pages - 1
        if seg_pages + own > cap:
            raise RequestTooLong(
                f"mode='compose'/'blend' needs the {len(chain)} segments' own KV ({seg_pages} pages) resident "
                f"beside the request's {own} new pages, {seg_pages + own} pages in all, but the KV page pool "
                f"holds {cap} pages of {s} tokens; use mode='exact', fewer segments, or raise hbm_pages")

    def _check_chain_fits(self, chain: list[Segment], total: int, max_tokens: int) -> None:
        """An exact request over several segments reads one chain node per prefix of its chain,
        all resident while it runs: node i holds its pages past its parent's full ones (the
        partial page it continues is copied), the request its pages past the last node's.  More
        pages than the pool has could never be admitted: refused now, not retried forever."""
        s, cap = self.config.page_size, self.pool.num_pages - 1
        ends, at = [], len(self.bos_prefix)
        for seg in chain:
            at += len(seg.token_ids)
            ends.append(at)
        nodes = -(-ends[0] // s) + sum(-(-end // s) - before // s for before, end in zip(ends, ends[1:]))
        own = -(-(total + max_tokens) // s) - min(ends[-1], total - 1) // s
        if nodes + own > cap:
            raise RequestTooLong(
                f"the chain of {len(chain)} segments needs {nodes} KV pages for its chain nodes (one per prefix "
                f"of the chain, each from its parent's last page on) and {own} for the request, {nodes + own} "
                f"pages in all, but the KV page pool holds {cap} pages of {s} tokens: name fewer segments (or "
                f"register their text as one segment), or raise hbm_pages")

    @property
    def compiles(self) -> int:
        return self.runner.compiles

    _warmup_stopped = False  # set by stop_warmup: a running or later warmup returns early

    def _loaded(self) -> int:
        """Step executables loaded from the executable store so far (exe_store.py)."""
        return self.runner.exe_store.loads if self.runner.exe_store is not None else 0

    def _stored(self) -> int:
        """Step executables saved into the executable store so far (exe_store.py)."""
        return self.runner.exe_store.saves if self.runner.exe_store is not None else 0

    def warmup(self, progress=None, *, serving: bool = True, buckets: str = "auto",
               progress_bar: bool = True, first_runs: str = "now") -> dict:
        """Compile the step buckets of a warm-up set now (``buckets.py``: decode, cascade and
        mixed steps, with and without log-probs), before any request pays for a compile; with the
        persistent compilation cache a restart loads them instead.  ``buckets``: "all", "small"
        (what a small server runs; the rest compile on first use) or "auto" ("small" on the CPU,
        "all" on a GPU/TPU).  Buckets compile several at a time (``ModelRunner.warmup``).
        ``progress(done, total)`` is called after each bucket, and a tqdm bar on stderr shows the
        buckets done, how many came from the compilation cache, and the ETA (``progress_bar``).
        From here on every compile is counted in ``stats()["compiles_after_warmup"]``; one of a
        bucket of the set is logged as a warning with its shape (a bucket outside a "small" set, at
        INFO).  ``serving=False``: only the buckets a batch job of segment registrations runs (no
        log-probs, no cascade; ``precompute``).  ``stop_warmup()`` (another thread) ends it
        early.  On an accelerator each bucket then runs once on padding (``ModelRunner.warmup``);
        ``first_runs="idle"`` leaves those runs to ``warm_idle`` (``serve``: ready ~0.1 s a bucket
        sooner, the runs done while no request is running).  Returns ``{"buckets", "compiled",
        "seconds", "stopped"}``.  Optional for the Python API; ``serve``, ``demo`` and
        ``precompute`` call it."""
        import sys

        from tqdm import tqdm

        from inferscale_jax.buckets import WARMUP_SETS

        if self.fault is not None:
            raise self.fault
        if buckets not in WARMUP_SETS:
            raise ValueError(f"buckets={buckets!r} is invalid: must be one of {WARMUP_SETS}")
        check_first_runs(first_runs)
        if buckets == "auto":
            buckets = "small" if self.runner.device.platform == "cpu" else "all"
        t0 = time.perf_counter()
        before, hits0, stored0 = self.runner.compiles, compile_cache.counts()["hits"], self._stored()
        loaded0 = self._loaded()
        store = self.runner.exe_store
        early0 = store.preloaded if store is not None else 0
        b = self.runner.buckets
        cascade = self.config.cascade_decode and serving
        keys = b.warmup_keys(buckets, cascade=cascade, logprobs=serving)
        self.runner.warm_skipped = frozenset(b.warmup_keys("all", cascade=cascade)) - frozenset(keys)
        bar = tqdm(total=len(keys), desc=f"warm-up ({buckets} step buckets)", unit="bucket", file=sys.stderr,
                   disable=not progress_bar, dynamic_ncols=True, leave=True)

        def step(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix_str(f"{compile_cache.counts()['hits'] - hits0} from the compile cache, "
                                f"{self._loaded() - loaded0} from the executable store", refresh=True)
            if progress is not None:
                progress(done, total)

        try:
            done = self.runner.warmup(keys, step, stop=lambda: self._warmup_stopped,
                                      first_runs=first_runs == "now" or not self.IDLE_WARM)
            if self.config.decode_steps > 1 and serving and not self._warmup_stopped:
                # the decode buckets' loops too (decode_loop.py), with the stop width of EOS
                eos = frozenset(self.cfg.eos_token_ids)
                loops = self.runner.warmup_loops(keys, self.config.decode_steps, eos,
                                                 stop=lambda: self._warmup_stopped)
                log.info("warm-up: %d decode loops of %d steps ready", loops, self.config.decode_steps)
        finally:
            bar.close()
        self.runner.warm = True
        b.real_tokens = b.padded_tokens = b.real_rows = b.padded_rows = 0  # (warm-up steps are all padding)
        freeze_heap()
        took = time.perf_counter() - t0
        compiled = self.runner.compiles - before
        parts = self.runner.warmup_times
        early = store.preloaded - early0 if store is not None else 0
        if store is not None:
            store.drop_early()
        log.info("warm-up: %d %s step buckets ready (%d compiled or loaded: %d from the compile cache, %d from the "
                 "executable store (%d of them from the loads begun beside the weights), %d stored) in %.1f s "
                 "(%s)%s", done, buckets, compiled, compile_cache.counts()["hits"] - hits0, self._loaded() - loaded0,
                 early, self._stored() - stored0, took,
                 ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), " (stopped)" if self._warmup_stopped else "")
        return {"buckets": done, "compiled": compiled, "seconds": took, "stopped": self._warmup_stopped, **parts}

    @property
    def first_runs_left(self) -> int:
        """Buckets whose first run ``warmup(first_runs="idle")`` left and no step has made yet."""
        return 0 if self._warmup_stopped else len(self.runner.first_runs)

    def warm_idle(self) -> bool:
        """One first run ``warmup(first_runs="idle")`` left, if the engine is idle (no request
        unfinished, no step for ``IDLE_QUIET_S``; a last step still in flight is read first);
        returns whether it ran one and more are left (False: nothing to do now).  Serving loops
        call it while they wait for work, so a bucket's first real step rarely pays its setup and
        a request arriving between two others never waits for one."""
        if not self.first_runs_left or self.fault is not None or self.has_unfinished():
            return False
        if time.monotonic() - self._stepped_at < self.IDLE_QUIET_S:
            return False
        if self.loop.inflight is not None:  # a last step whose rows' requests had ended before it
            late = self.loop.drain()  # (nothing runs, so nothing of it is anyone's)
            if late:
                log.warning("warm_idle: %d output(s) of a step read after its requests ended", len(late))
        self.runner.run_first()
        return self.first_runs_left > 0

    def stop_warmup(self) -> None:
        """End a running ``warmup`` (and skip any later one): it starts nothing more and returns
        once the compiles in flight finish (``serve`` calls this at shutdown)."""
        self._warmup_stopped = True

    def stats(self) -> dict:
        c = self._counters
        return {
            "pages_total": self.pool.num_pages - 1,
            "pages_used": self.pool.num_used,
            "pages_free": self.pool.num_free,
            "page_size": self.config.page_size,
            "segments": len(self.store) - sessions.count(self),
            "sessions": sessions.count(self),
            "chain_nodes": len(self.store.nodes()),
            "prefix_cached_pages": len(self.prefix_cache),
            "requests": c["requests"],
            "prompt_tokens": c["prompt_tokens"],
            "cached_tokens": c["cached_tokens"],
            "generated_tokens": c["generated_tokens"],
            "segment_tokens_computed": c["segment_tokens_computed"],  # register / update / append_segment
            "hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            "compiles": self.runner.compiles,
            "warm": self.runner.warm,
            "compiles_after_warmup": self.runner.compiles_after_warmup,
            # the sampler's own small executables compiled on first use (rows that draw in a shape or with
            # options the warm-up left out: top-k / top-p, penalties, log-probs, grammars); not steps
            "sampler_compiles": self.runner.sampler_compiles,
            # buckets whose first run warmup(first_runs="idle") left and no step has made yet (a step that
            # meets one pays it, ~80 ms for the 8B model: bench/NOTES.md, run AO)
            "first_runs_left": self.first_runs_left,
            "max_batch": self.max_batch,
            "max_num_batched_tokens": self.runner.max_tokens,
            **self.runner.buckets.padding_stats(),
            "compile_cache_dir": self.compilation_cache_dir,
            "compile_cache_hits": compile_cache.counts()["hits"],
            "compile_cache_misses": compile_cache.counts()["misses"],
            "running": len(self.scheduler.running),
            # queued requests and those waiting on a node job (scheduler.py, 2)
            "waiting": self.scheduler.num_waiting,
            "node_jobs": len(self.scheduler.jobs),
            "tenants": self.scheduler.tenant_counts(),
            "preemptions": self.scheduler.preemptions,
            # device steps dispatched, with their rows (all, decode) and tokens, summed
            "steps": self.scheduler.steps,
            "step_rows": self.scheduler.step_rows,
            "step_decode_rows": self.scheduler.step_decode_rows,
            "step_tokens": self.scheduler.step_tokens,
            # the tokens those steps were padded to (their buckets': buckets.py; warm-up steps not counted)
            "step_padded_tokens": self.runner.buckets.padded_tokens,
            # of those steps, decode loops (decode_loop.py; EngineConfig.decode_steps > 1)
            "decode_loops": self.scheduler.loops,
            "attention_impl": self.runner.cache.impl,
            "kv_dtype": self.config.kv_dtype or self.config.dtype,
            "kv_bytes_per_token": self.tiers.page_nbytes // self.config.page_size,  # all layers, K and V (+ scales)
            "tokens_resident": self.tiers.stats()["tokens_resident"],
            "mesh": sharding.mesh_stats(self.mesh, self.runner.device),
            "tiers": self.tiers.stats(),
            "snapshot": self.persistence.stats() if self.persistence is not None else None,
        }

    def check_page_accounting(self) -> None:
        """Between steps: every page's refcount is exactly the chain nodes, the running requests
        and the node jobs (``scheduler.py``, 2) that list it, and the pool's own invariants hold
        (``AssertionError`` if not)."""
        seqs = [r.seq for r in self.scheduler.running] + [j.seq for j in self.scheduler.jobs.values()]
        want = Counter(p for holder in [*self.store.nodes(), *(q for q in seqs if q is not None)]
                       for p in holder.pages)
        for p in range(1, self.pool.num_pages):
            got = self.pool.refcount(p)
            assert got == want[p], f"page {p} has refcount {got} but {want[p]} holders"
        self.pool.check_invariants()
        self.check_invariants()

    def check_invariants(self) -> None:
        """Page accounting: pool/cache consistent; every node's pages referenced (tests call this)."""
        self.kv.check_invariants()

    # -- tiers and persistence (tiers.py, snapshot.py, registry.py) -------------------------
    def save_snapshot(self) -> dict:
        """Write every segment's KV (all tiers) to ``snapshot_dir`` now; returns the step's summary."""
        if self.persistence is None:
            raise ValueError("save_snapshot() needs EngineConfig(snapshot_dir=...): this engine has none")
        return self.persistence.save(wait=True)

    def maybe_snapshot(self) -> bool:
        """Periodic snapshot (background) when due; serving loops call this between steps."""
        return self.persistence is not None and self.persistence.maybe_snapshot()

    def segment_tier(self, segment_id: str, tenant: str = "default") -> str:
        """Where the segment's KV is now: "hbm", "host", "disk" or "recompute"."""
        return self.tiers.where(self.store.resolve(segment_id, tenant))

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output grammar compiler (structured.py), made on first use."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.cfg.vocab_size, self.cfg.eos_token_ids)
        return self._grammars

    def close(self) -> None:
        """Clean shutdown: a final snapshot if segments changed since the last one."""
        if self._grammars is not None:
            self._grammars.close()
        try:
            if self.persistence is not None:
                self.persistence.close()
        finally:
            self.tiers.close()  # its temporary disk-tier folder goes even if the final snapshot fails

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
