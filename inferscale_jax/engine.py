"""The ``Engine``: segments, exact KV injection, prefix caching and generation over paged KV.

Life of a request (``generate``):

1. **Resolve** each named segment in the tenant's namespace (then the public one); an unknown
   or foreign id is ``SegmentNotFound``.  Check lengths against the model and the pool
   (``RequestTooLong``) and the sampling parameters (``ValueError`` naming the field).
2. **Chain**: walk the chain index for ``[s1]``, ``[s1, s2]``, ... (``segments.py``).  A
   missing node ``[s1..si]`` is computed once, exactly: its parent's pages are reused (full
   pages shared, the partially filled last page copied), ``si``'s tokens are prefilled at
   their real positions over that context, and the node is cached.
3. **Materialize** the request's sequence (``_materialize``): share the final node's pages,
   look up the prompt's following full pages in the prefix cache (hash chain seeded with the
   tenant and the model fingerprint), copy-on-write a partially filled shared page, allocate
   the rest, and prefill what is left in chunks.  At least the last token is always computed
   (its logits give the first output token).  ``cached_tokens`` counts the tokens whose KV
   was reused.
4. **Decode** one token per step, allocating a page when the sequence crosses a page
   boundary and registering every page that fills in the prefix cache, until EOS, a stop
   token / string, or ``max_tokens``.
5. **Release** the request's page references (its full pages stay cached, reusable until the
   pool needs them) and the chain nodes' reader counts.

Shared pages are never written: a request writes only pages it allocated (including its
private copy of a shared partial page).  Continuous batching, preemption and the
compose/blend modes are built on the same pieces by the scheduler (a later stage); here one
request runs at a time, through a runner that already steps batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from inferscale_jax.config import EngineConfig
from inferscale_jax.errors import RequestTooLong
from inferscale_jax.kv_cache import PagedKVCache, page_bytes
from inferscale_jax.outputs import GenerationOutput, RequestMetrics
from inferscale_jax.page_pool import PagePool
from inferscale_jax.prefix_cache import PUBLIC_TENANT, PrefixCache, page_hash, public_root, root_hash
from inferscale_jax.runner import ModelRunner, StepResult, StepRow
from inferscale_jax.sampling import SamplingParams, request_key
from inferscale_jax.segments import ChainNode, Segment, SegmentInfo, SegmentStore
from models import ModelConfig, inv_freq
from models.loader import config_digest, load_params, weights_digest

log = logging.getLogger("inferscale.engine")
MODES = ("exact", "compose", "blend")


class PoolExhausted(RuntimeError):
    """Not enough free KV pages right now (all are held by segments or running requests)."""


@dataclasses.dataclass
class _Seq:
    """A sequence whose KV lives in pages the holder owns one reference on each of."""
    root: bytes
    tokens: list[int]
    pages: list[int]
    hashes: list[bytes]  # hash of each full page of ``tokens`` (extended as pages fill)
    first_own: int  # pages below this index were borrowed (shared node pages / prefix hits)
    computed: int  # tokens whose KV is in pages
    cached: int  # tokens whose KV was reused rather than computed


class Engine:
    def __init__(self, params: dict, cfg: ModelConfig, tokenizer=None, config: EngineConfig | None = None,
                 fingerprint: str | None = None):
        self.config = config = config or EngineConfig()
        self.cfg, self.params, self.tokenizer = cfg, params, tokenizer
        self.dtype = jnp.dtype(config.dtype)
        s = config.page_size
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        # model fingerprint = config + weights digest (given by from_pretrained) + dtype + page size
        base = fingerprint or f"{config_digest(cfg)}|unnamed-weights"
        self.fingerprint = hashlib.sha256(f"{base}|{config.dtype}|{s}".encode()).hexdigest()
        num_pages = config.hbm_pages or self._auto_pages()
        impl = config.attention_impl
        if impl == "auto":
            pow2 = cfg.head_dim >= 16 and cfg.head_dim & (cfg.head_dim - 1) == 0
            impl = "pallas" if jax.default_backend() == "gpu" and pow2 else "ref"
        self.pool = PagePool(num_pages)
        self.prefix_cache = PrefixCache(self.pool, s)
        self.store = SegmentStore()
        cache = PagedKVCache.create(cfg, num_pages, s, self.dtype, impl)
        self.runner = ModelRunner(params, cfg, cache, max_batch=config.max_batch,
                                  prefill_chunk=config.prefill_chunk,
                                  max_pages_per_seq=-(-self.max_model_len // s),
                                  inv_freq=inv_freq(cfg.rope, cfg.head_dim),
                                  min_table_pages=config.min_table_pages)
        self.bos_prefix: list[int] = []
        if tokenizer is not None and getattr(tokenizer, "bos_token_id", None) is not None:
            if tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]:
                self.bos_prefix = [tokenizer.bos_token_id]
        self._counters = dict(requests=0, prompt_tokens=0, cached_tokens=0, generated_tokens=0)
        self.debug_checks = False  # tests: check page accounting after every device step

    @classmethod
    def from_pretrained(cls, model_dir: str | None = None, config: EngineConfig | None = None) -> "Engine":
        """Load an HF checkpoint folder (default: the embedded default model)."""
        from inferscale_jax.default_model import default_model_dir
        from inferscale_jax.tokenizer import load_tokenizer

        config = config or EngineConfig()
        model_dir = model_dir or default_model_dir()
        cfg = ModelConfig.from_pretrained(model_dir)
        params = load_params(model_dir, cfg, jnp.dtype(config.dtype))
        try:
            tokenizer = load_tokenizer(model_dir)
        except ValueError as e:
            log.warning("%s; the engine accepts token ids only", e)
            tokenizer = None
        fp = hashlib.sha256(f"{config_digest(cfg)}|{weights_digest(model_dir)}".encode()).hexdigest()
        return cls(params, cfg, tokenizer, config, fingerprint=fp)

    def _auto_pages(self) -> int:
        per_page = page_bytes(self.cfg, self.config.page_size, self.dtype)
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            return max(2, int(free * self.config.hbm_fraction) // per_page)
        return max(2, min(4096, (1 << 30) // per_page))  # host-only backends: up to 1 GiB

    # -- tokens ---------------------------------------------------------------------------
    def _encode(self, text: str, field: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{field}: this model folder has no tokenizer; pass token ids instead")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _check_ids(self, ids, field: str) -> list[int]:
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{field} holds token id {bad[0]} outside [0, {self.cfg.vocab_size}) "
                             "(the model's vocab size)")
        return ids

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _root(self, namespace: str) -> bytes:
        if namespace == PUBLIC_TENANT:
            return public_root(self.fingerprint)
        return root_hash(namespace, self.fingerprint)

    # -- pages ----------------------------------------------------------------------------
    def _allocate(self, n: int) -> list[int]:
        if n == 0:
            return []
        while True:
            pages = self.pool.allocate(n)
            if pages is not None:
                return pages
            victims = self.store.evictable_nodes()
            if not victims:
                raise PoolExhausted(
                    f"need {n} free KV pages but only {self.pool.num_free} of {self.pool.num_pages - 1} are free; "
                    "the rest are held by segments and running requests: delete segments or raise hbm_pages")
            self._release_node(victims[0])
            self.store.drop_node(victims[0])

    def _release_node(self, node: ChainNode) -> None:
        self.pool.decref(reversed(node.pages))

    def _materialize(self, root: bytes, tokens: list[int], base: ChainNode | None, want_logits: bool,
                     row: StepRow | None = None, num_logprobs: int = 0) -> tuple[_Seq, StepResult | None]:
        """Get KV for ``tokens`` into pages the returned sequence owns (see module docstring, 3)."""
        s, n = self.config.page_size, len(tokens)
        fork = min(base.num_tokens, n - 1) if (base and want_logits) else (base.num_tokens if base else 0)
        k = fork // s
        hashes = self.prefix_cache.hashes_for(root, tokens)
        limit = (n - 1) // s if want_logits else n // s
        shared = base.pages[:k] if base else []
        self.pool.incref(shared)
        hits = self.prefix_cache.lookup(hashes[k:limit]) if limit > k else []
        pages = shared + hits
        pos = (k + len(hits)) * s
        cow = base.pages[k] if (base and not hits and fork % s) else None
        if cow is not None:
            pos = fork
        try:
            new = self._allocate(-(-n // s) - len(pages))
        except Exception:
            self.pool.decref(reversed(pages))
            raise
        if cow is not None:
            self.runner.copy_pages([cow], [new[0]])
        pages += new
        seq = _Seq(root, list(tokens), pages, hashes, first_own=k + len(hits), computed=pos, cached=pos)
        result = None
        chunk = self.config.prefill_chunk
        row = row or StepRow([], 0, [])
        for c in range(pos, n, chunk):
            row = dataclasses.replace(row, tokens=tokens[c:c + chunk], start=c, pages=pages)
            result = self._step([row], num_logprobs)
        seq.computed = n
        for i in range(seq.first_own, n // s):
            self.prefix_cache.insert(hashes[i], pages[i])
        return seq, result

    def _step(self, rows: list[StepRow], num_logprobs: int) -> StepResult:
        result = self.runner.step(rows, num_logprobs)
        if self.debug_checks:
            self.check_invariants()
        return result

    # -- segments -------------------------------------------------------------------------
    def register_segment(self, segment_id: str, text: str | None = None, token_ids=None, *,
                         tenant: str = "default", public: bool = False, pin: bool = False) -> SegmentInfo:
        """Compute a segment's KV once and keep it under ``segment_id`` in the tenant's namespace."""
        if not isinstance(segment_id, str) or not segment_id or len(segment_id) > 256:
            raise ValueError(f"segment_id={segment_id!r} is invalid: use a non-empty string of at most 256 chars")
        if (text is None) == (token_ids is None):
            raise ValueError("register_segment needs exactly one of text= or token_ids=")
        self._check_tenant(tenant)
        ids = self._encode(text, "text") if text is not None else self._check_ids(token_ids, "token_ids")
        if not ids:
            raise ValueError(f"segment {segment_id!r} is empty: give at least one token")
        ns = self.store.check_new(segment_id, tenant, public)
        total = len(self.bos_prefix) + len(ids)
        self._check_fits(total, f"segment {segment_id!r}")
        seq, _ = self._materialize(self._root(ns), self.bos_prefix + ids, None, want_logits=False)
        info = SegmentInfo(id=segment_id, tenant=tenant, num_tokens=len(ids), public=public, pin=pin,
                           created=time.time())
        seg = self.store.add(info, ids)
        self.store.add_node(ChainNode(ns, (seg.uid,), len(seq.tokens), seq.pages))
        return info

    def list_segments(self, tenant: str = "default") -> list[SegmentInfo]:
        return self.store.visible(tenant)

    def delete_segment(self, segment_id: str, tenant: str = "default") -> None:
        """Forget a segment; its pages are freed once no running request reads them."""
        seg = self.store.owned(segment_id, tenant)
        for node in self.store.remove(seg):
            self._release_node(node)

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompt: str | None = None, *, prompt_token_ids=None, segments=(),
                 tenant: str = "default", sampling: SamplingParams | None = None,
                 mode: str = "exact") -> GenerationOutput:
        t0 = time.perf_counter()
        sampling = sampling or SamplingParams()
        sampling.validate(self.cfg.vocab_size)
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid: must be one of {MODES}")
        if mode != "exact" and len(segments) > 1:
            raise NotImplementedError(f"mode={mode!r} is not available yet; use mode='exact'")
        self._check_tenant(tenant)
        if prompt is not None and prompt_token_ids is not None:
            raise ValueError("give prompt= or prompt_token_ids=, not both")
        ids = (self._encode(prompt, "prompt") if prompt is not None
               else self._check_ids(prompt_token_ids or [], "prompt_token_ids"))
        chain = [self.store.resolve(sid, tenant) for sid in segments]
        if not ids and not chain:
            raise ValueError("prompt is empty and no segments are named: give at least one token")
        seq_tokens = list(self.bos_prefix) + [t for seg in chain for t in seg.token_ids] + ids
        self._check_fits(len(seq_tokens) + sampling.max_tokens, "request",
                         detail=f" ({len(seq_tokens)} prompt + {sampling.max_tokens} max_tokens)")
        nodes: list[ChainNode] = []
        try:
            node, computed_now = self._walk_chain(chain, nodes)
            out = self._run(tenant, seq_tokens, node, sampling, computed_now, t0)
        finally:
            for nd in nodes:
                nd.readers -= 1
        return out

    def _walk_chain(self, chain: list[Segment], nodes: list[ChainNode]) -> tuple[ChainNode | None, int]:
        node, computed = None, 0
        for i in range(len(chain)):
            sub = chain[:i + 1]
            found = self.store.node(sub)
            if found is None:
                assert node is not None, "a registered segment always has its root node"
                ns = self.store.chain_namespace(sub)
                toks = list(self.bos_prefix) + [t for seg in sub for t in seg.token_ids]
                seq, _ = self._materialize(self._root(ns), toks, node, want_logits=False)
                computed += len(toks) - seq.cached
                found = ChainNode(ns, tuple(seg.uid for seg in sub), len(toks), seq.pages)
                self.store.add_node(found)
            found.readers += 1
            nodes.append(found)
            node = found
        return node, computed

    def _run(self, tenant: str, tokens: list[int], node: ChainNode | None, sampling: SamplingParams,
             computed_now: int, t0: float) -> GenerationOutput:
        self._counters["requests"] += 1
        key = np.asarray(request_key(sampling.seed, self._counters["requests"]))
        row = StepRow([], 0, [], temperature=float(sampling.temperature), top_k=sampling.top_k,
                      top_p=float(sampling.top_p), key=key, sample_step=0)
        nl = sampling.logprobs or 0
        want_lp = sampling.logprobs is not None
        seq, res = self._materialize(self._root(tenant), tokens, node, want_logits=True, row=row,
                                     num_logprobs=nl if want_lp else 0)
        ttft = time.perf_counter() - t0
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.cfg.eos_token_ids))
        s = self.config.page_size
        out_ids: list[int] = []
        logprobs: list[dict[int, float]] = []
        finish, text = "length", None
        t_first = time.perf_counter()
        try:
            while True:
                tok = int(res.tokens[0])
                out_ids.append(tok)
                if want_lp:
                    lp = {int(i): float(v) for i, v in zip(res.top_ids[0], res.top_logprobs[0])}
                    lp[tok] = float(res.logprob[0])
                    logprobs.append(lp)
                if tok in stop_ids:
                    finish = "stop"
                    break
                if sampling.stop:
                    text = self._decode(out_ids)
                    cut = min((text.find(x) for x in sampling.stop if x in text), default=-1)
                    if cut >= 0:
                        finish, text = "stop", text[:cut]
                        break
                    text = None
                if len(out_ids) >= sampling.max_tokens:
                    break
                pos = len(seq.tokens)
                seq.tokens.append(tok)
                if pos // s >= len(seq.pages):
                    seq.pages += self._allocate(1)
                res = self._step([dataclasses.replace(
                    row, tokens=[tok], start=pos, pages=seq.pages, sample_step=len(out_ids))],
                    nl if want_lp else 0)
                seq.computed = pos + 1
                if seq.computed % s == 0:
                    i = seq.computed // s - 1
                    parent = seq.hashes[i - 1] if i else seq.root
                    seq.hashes.append(page_hash(parent, seq.tokens[i * s:(i + 1) * s]))
                    self.prefix_cache.insert(seq.hashes[i], seq.pages[i])
        finally:
            self.pool.decref(reversed(seq.pages))
        t_end = time.perf_counter()
        cached = max(0, seq.cached - computed_now)
        self._counters["prompt_tokens"] += len(tokens)
        self._counters["cached_tokens"] += cached
        self._counters["generated_tokens"] += len(out_ids)
        dec_s = t_end - t_first
        metrics = RequestMetrics(
            ttft_s=ttft, prompt_tokens=len(tokens), cached_tokens=cached, generated_tokens=len(out_ids),
            decode_tokens_per_s=(len(out_ids) - 1) / dec_s if len(out_ids) > 1 and dec_s > 0 else 0.0,
            e2e_s=t_end - t0)
        return GenerationOutput(text=text if text is not None else self._decode(out_ids), token_ids=out_ids,
                                finish_reason=finish, metrics=metrics,
                                logprobs=logprobs if want_lp else None,
                                request_id=f"req-{self._counters['requests']}")

    # -- checks and stats -----------------------------------------------------------------
    def _check_tenant(self, tenant: str) -> None:
        if not isinstance(tenant, str) or not tenant or tenant == PUBLIC_TENANT:
            raise ValueError(f"tenant={tenant!r} is invalid: use a non-empty name other than {PUBLIC_TENANT!r}")

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

    @property
    def compiles(self) -> int:
        return self.runner.compiles

    def stats(self) -> dict:
        c = self._counters
        return {
            "pages_total": self.pool.num_pages - 1,
            "pages_used": self.pool.num_used,
            "pages_free": self.pool.num_free,
            "page_size": self.config.page_size,
            "segments": len(self.store),
            "chain_nodes": len(self.store.nodes()),
            "prefix_cached_pages": len(self.prefix_cache),
            "requests": c["requests"],
            "prompt_tokens": c["prompt_tokens"],
            "cached_tokens": c["cached_tokens"],
            "generated_tokens": c["generated_tokens"],
            "hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            "compiles": self.runner.compiles,
            "attention_impl": self.runner.cache.impl,
        }

    def check_invariants(self) -> None:
        """Page accounting: pool/cache consistent; every node's pages referenced (tests call this)."""
        self.prefix_cache.check_invariants()
        for node in self.store.nodes():
            for p in node.pages:
                assert self.pool.refcount(p) > 0, f"chain node {node.key} lists unreferenced page {p}"
