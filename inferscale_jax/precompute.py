"""Bulk precompute: a corpus of documents -> segments, through a grain pipeline and batched prefill.

``inferscale precompute CORPUS --snapshot-dir DIR`` (``inferscale_cli/main.py``) and ``precompute(engine, corpus)``
store every document of a corpus as a segment (id = the document's id) and write a snapshot, so a
server started on that ``snapshot_dir`` has their KV ready.

Corpus formats
==============

- **JSONL**: one JSON object per line with a string ``id`` (an integer is taken as its decimal
  string) and a string ``text``.  Blank lines are ignored.  Records are numbered by their line.
- **A folder**: every ``*.txt`` / ``*.md`` file below it (sorted), read as UTF-8; the id is the
  path relative to the folder, with ``/`` separators.  Records are named by that path.

Life of a run
=============

1. **Index**: the source (``JsonlSource`` / ``FolderSource``, grain random-access sources) scans
   the file for line offsets (or lists the folder); nothing is parsed yet.  The hashes of the
   documents already stored (``text_sha256`` in the registry's ``segment_meta``, ``registry.py``)
   are loaded for the live segments of the target namespace (tenant, or public).
2. **Parse and tokenize** (``grain.MapDataset`` ``.map``, run by a pool of threads in order): each
   record is checked -- invalid JSON, not an object, a missing or non-string field, empty text,
   undecodable bytes, more tokens than the model or the page pool holds are *bad* records:
   reported with their line number and skipped.  A document whose text hash equals the stored one
   is *unchanged* and is not even tokenized.  The rest are tokenized (``tokenizer.encode``
   without special tokens, exactly as ``register_segment(text=...)`` does).
3. **Deduplicate** (in line order): a second record with an already seen id is bad ("duplicate id,
   first at line N"), so the first occurrence always wins, in every run.
4. **Bucket** (``LengthBuckets``, a grain ``IterDataset``): documents to compute wait in buckets of
   similar token length (4 per octave) and leave as a batch when ``batch`` documents (or
   ``batch_tokens`` tokens) share a bucket; at the end, what is left is merged in length order
   into full batches (neighbouring buckets are close in length).  Bad and unchanged records pass
   straight through.
5. **Compute**: per batch, a document whose id is stored with other text is an *update*: the old
   segment is deleted (its pages are freed; full pages the new text shares with it stay in the
   prefix cache and are reused) and the new text registered under the same id (should that fail,
   the id is absent until a re-run stores it).  The
   batch goes through ``Engine.register_segments_batch``: one device step runs a chunk of every
   document of the batch.  A stored segment with no recorded hash (registered through the API,
   or a crash between its registration and its hash) counts as unchanged when its token ids
   equal the document's.  The batch's hashes are then recorded (one transaction).
6. **Snapshot** (``engine.save_snapshot()``, only when a document was computed: a run with
   nothing new writes none) and a summary: documents stored / unchanged / updated / bad, tokens
   computed, documents/s and tokens/s.

``pending(engine, corpus, ...)`` is steps 1-2 without tokenizing: how many records are new or
changed (text hash, per id).  The CLI calls it before ``Engine.warmup``, so a re-run with
nothing to do compiles nothing and exits in seconds.

A progress bar (tqdm, on stderr) counts records and shows tokens/s.  The run is resumable: an
interrupted run has durably registered (and hashed) every batch it finished, so re-running
computes only the rest.  A failure in one batch (say, the pool cannot hold a document) is
reported for that batch's documents, which are then tried one by one; it never aborts the run.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable

import grain
from tqdm import tqdm

from inferscale_jax.errors import SegmentNotFound
from inferscale_jax.prefix_cache import PUBLIC_TENANT
from inferscale_jax.segments import check_tenant

log = logging.getLogger("inferscale.precompute")
HASH_KEY = "text_sha256"
TEXT_SUFFIXES = (".txt", ".md")


@dataclasses.dataclass
class Doc:
    """One corpus record on its way through the pipeline."""
    where: str  # "line 12" (JSONL) or the file's relative path (folder)
    order: int  # position in the corpus (line number, or file index + 1)
    id: str | None = None
    text: str | None = None
    sha: str | None = None  # sha256 of the UTF-8 text
    tokens: list[int] | None = None
    status: str = "todo"  # "todo" (to compute) | "unchanged" | "bad"
    error: str | None = None


@dataclasses.dataclass
class PrecomputeResult:
    stored: int = 0  # new documents computed
    updated: int = 0  # documents whose text changed: recomputed, old version freed
    unchanged: int = 0  # skipped: stored with the same text
    bad: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (where, reason)
    tokens: int = 0  # tokens computed (new + updated documents)
    seconds: float = 0.0  # the pipeline and the computation, without the snapshot
    snapshot_s: float = 0.0
    snapshot: dict | None = None
    deleted: int = 0  # old versions deleted for an update (a failed re-registration leaves the id absent)

    @property
    def computed(self) -> int:
        return self.stored + self.updated

    @property
    def docs_per_s(self) -> float:
        return self.computed / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        lines = [f"documents: {self.stored} stored, {self.unchanged} skipped unchanged, {self.updated} updated, "
                 f"{len(self.bad)} bad",
                 f"computed {self.computed} documents, {self.tokens} tokens in {self.seconds:.2f} s: "
                 f"{self.docs_per_s:.1f} docs/s, {self.tokens_per_s:.0f} tokens/s"]
        if self.snapshot is not None:
            lines.append(f"snapshot step {self.snapshot.get('step')}: {self.snapshot.get('segments')} segments "
                         f"in {self.snapshot_s:.2f} s")
        return "\n".join(lines)


# -- sources (grain random-access data sources) ---------------------------------------------
class JsonlSource:
    """Line ``i`` of a JSONL file as ``(line_number, bytes)``; a one-pass scan indexes the line offsets."""

    def __init__(self, path: str):
        self.path = path
        # per non-blank line: its number, byte offset and length (8 bytes each, for large corpora)
        self._number, self._offset, self._length = array.array("q"), array.array("q"), array.array("q")
        offset = 0
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    self._number.append(number)
                    self._offset.append(offset)
                    self._length.append(len(line))
                offset += len(line)
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self._number)

    def __getitem__(self, i: int) -> tuple[int, bytes]:
        # a positioned read: safe from the pipeline's threads
        return self._number[i], os.pread(self._fd, self._length[i], self._offset[i])

    def close(self) -> None:
        os.close(self._fd)


class FolderSource:
    """File ``i`` (sorted ``*.txt`` / ``*.md`` below ``root``) as ``(relative path, bytes)``."""

    def __init__(self, root: str):
        self.root = root
        self.paths = sorted(
            os.path.relpath(os.path.join(d, name), root).replace(os.sep, "/")
            for d, _, names in os.walk(root) for name in names if name.endswith(TEXT_SUFFIXES))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[str, bytes]:
        with open(os.path.join(self.root, self.paths[i]), "rb") as f:
            return self.paths[i], f.read()

    def close(self) -> None:
        pass


# -- pipeline stages --------------------------------------------------------------------------
def parse_jsonl(item: tuple[int, bytes], index: int) -> Doc:
    number, raw = item
    doc = Doc(where=f"line {number}", order=number)
    try:
        rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _bad(doc, f"invalid JSON ({e})")
    if not isinstance(rec, dict):
        return _bad(doc, f"expected a JSON object with 'id' and 'text', got {type(rec).__name__}")
    missing = [k for k in ("id", "text") if k not in rec]
    if missing:
        return _bad(doc, "missing field " + " and ".join(repr(k) for k in missing))
    sid, text = rec["id"], rec["text"]
    if isinstance(sid, int) and not isinstance(sid, bool):
        sid = str(sid)
    if not isinstance(sid, str) or not sid or len(sid) > 256:
        return _bad(doc, f"field 'id' must be a non-empty string of at most 256 chars, got {sid!r:.60}")
    doc.id = sid
    if not isinstance(text, str):
        return _bad(doc, f"field 'text' must be a string, got {type(text).__name__}")
    doc.text = text
    return doc


def parse_file(item: tuple[str, bytes], index: int) -> Doc:
    rel, raw = item
    doc = Doc(where=rel, order=index + 1, id=rel)
    if len(rel) > 256:
        return _bad(doc, "relative path longer than 256 chars (segment ids are at most 256)")
    try:
        doc.text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _bad(doc, f"not UTF-8 text ({e})")
    return doc


def _bad(doc: Doc, why: str) -> Doc:
    doc.status, doc.error, doc.text = "bad", why, None
    return doc


class Tokenize:
    """Hash the text; skip it when stored unchanged; else tokenize and check the length."""

    def __init__(self, tokenizer, known: dict[str, str], prefix: int, limit: int, limit_why: str):
        self.tokenizer, self.known, self.prefix, self.limit, self.limit_why = tokenizer, known, prefix, limit, limit_why

    def __call__(self, doc: Doc) -> Doc:
        if doc.status == "bad":
            return doc
        if not doc.text.strip():
            return _bad(doc, "empty text")
        doc.sha = hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
        if self.known.get(doc.id) == doc.sha:
            doc.status, doc.text = "unchanged", None
            return doc
        doc.tokens = list(self.tokenizer.encode(doc.text, add_special_tokens=False))
        doc.text = None  # the tokens are what is kept from here on
        if not doc.tokens:
            return _bad(doc, "text encodes to no tokens")
        n = self.prefix + len(doc.tokens)
        if n > self.limit:
            return _bad(doc, f"{n} tokens exceed {self.limit_why} ({self.limit}); split the document")
        return doc


class Dedupe:
    """Sequential stage (after the threaded ones, so in corpus order): the first record of an id wins."""

    def __init__(self):
        self.first: dict[str, str] = {}

    def __call__(self, doc: Doc) -> Doc:
        if doc.status == "bad" or doc.id is None:
            return doc
        first = self.first.setdefault(doc.id, doc.where)
        if first != doc.where:
            return _bad(doc, f"duplicate id {doc.id!r} (first at {first})")
        return doc


def length_bucket(n: int) -> int:
    """Bucket key of an ``n``-token document: 16, then 4 buckets per octave (<= 25% apart)."""
    if n <= 16:
        return 16
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


class LengthBuckets(grain.IterDataset):
    """Groups documents to compute into batches of similar token length; other records pass
    through alone.  Elements are ``list[Doc]``."""

    def __init__(self, parent: grain.IterDataset, batch: int, batch_tokens: int):
        super().__init__(parent)
        self.batch, self.batch_tokens = batch, batch_tokens

    def __iter__(self) -> grain.DatasetIterator:
        return _LengthBucketIterator(self._parent.__iter__(), self.batch, self.batch_tokens)


class _LengthBucketIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, batch: int, batch_tokens: int):
        super().__init__(parent)
        self.batch, self.batch_tokens = batch, batch_tokens
        self.buckets: dict[int, list[Doc]] = {}
        self.tokens: dict[int, int] = {}
        self.exhausted = False
        self.leftover: list[list[Doc]] = []

    def __next__(self) -> list[Doc]:
        while not self.exhausted:
            try:
                doc = next(self._parent)
            except StopIteration:
                self.exhausted = True
                break
            if doc.status != "todo":
                return [doc]
            key = length_bucket(len(doc.tokens))
            group = self.buckets.setdefault(key, [])
            group.append(doc)
            self.tokens[key] = self.tokens.get(key, 0) + len(doc.tokens)
            if len(group) >= self.batch or self.tokens[key] >= self.batch_tokens:
                del self.tokens[key]
                return self.buckets.pop(key)
        if self.buckets:  # the end: what is left, merged in length order into full batches
            rest = [doc for key in sorted(self.buckets) for doc in self.buckets[key]]
            self.buckets = {}
            self.leftover = []
            group, tokens = [], 0
            for doc in rest:
                if group and (len(group) == self.batch or tokens + len(doc.tokens) > self.batch_tokens):
                    self.leftover.append(group)
                    group, tokens = [], 0
                group.append(doc)
                tokens += len(doc.tokens)
            self.leftover.append(group)
        if self.leftover:
            return self.leftover.pop(0)
        raise StopIteration

    def get_state(self) -> dict:
        raise NotImplementedError("precompute resumes from the registry, not from iterator checkpoints")

    def set_state(self, state: dict) -> None:
        raise NotImplementedError("precompute resumes from the registry, not from iterator checkpoints")


def build_pipeline(source, parse: Callable, tokenize: Tokenize, batch: int, batch_tokens: int,
                   threads: int) -> grain.IterDataset:
    """source -> parse -> tokenize (threads, order kept) -> dedupe -> length-bucketed batches."""
    ds = grain.MapDataset.source(source).map_with_index(lambda i, item: parse(item, i)).map(tokenize)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(64, 4 * batch)))
    return LengthBuckets(ds.map(Dedupe()), batch, batch_tokens)


# -- the run ----------------------------------------------------------------------------------
def open_source(corpus: str):
    if os.path.isdir(corpus):
        return FolderSource(corpus), parse_file
    if os.path.isfile(corpus):
        return JsonlSource(corpus), parse_jsonl
    raise FileNotFoundError(f"corpus {corpus!r} is neither a JSONL file nor a folder of .txt/.md files")


def _known_hashes(engine, ns: str) -> dict[str, str]:
    """id -> text hash of the live segments of namespace ``ns`` stored with one."""
    registry = engine.persistence.registry if engine.persistence is not None else None
    known: dict[str, str] = {}
    if registry is not None:
        for (rns, sid), (uid, sha) in registry.segment_meta(HASH_KEY).items():
            seg = _live(engine, rns, sid) if rns == ns else None
            if seg is not None and seg.uid == uid:
                known[sid] = sha
    return known


def pending(engine, corpus: str, *, tenant: str = "default", public: bool = False) -> int:
    """How many records of ``corpus`` ``precompute`` would compute: those whose id is not stored
    with the same text hash, records that fail to parse or have empty text left out."""
    check_tenant(tenant)
    known = _known_hashes(engine, PUBLIC_TENANT if public else tenant)
    source, parse = open_source(corpus)
    try:
        n = 0
        for i in range(len(source)):
            doc = parse(source[i], i)
            if doc.status == "todo" and doc.text.strip():  # (parsing rejects the rest, no compute needed)
                n += known.get(doc.id) != hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
        return n
    finally:
        source.close()


def _live(engine, namespace: str, segment_id: str):
    """The segment stored under ``segment_id`` in exactly ``namespace`` (or None)."""
    try:
        seg = engine.store.resolve(segment_id, namespace)
    except SegmentNotFound:
        return None
    return seg if seg.namespace == namespace else None


def precompute(engine, corpus: str, *, tenant: str = "default", public: bool = False, batch: int = 64,
               batch_tokens: int | None = None, step_tokens: int | None = None, threads: int | None = None,
               snapshot: bool = True, progress: bool = True,
               report: Callable[[str], None] | None = None) -> PrecomputeResult:
    """Store every document of ``corpus`` (a JSONL file or a folder) as a segment of ``engine``
    (module docstring).  ``batch``: documents per batch (one device step holds a chunk of each,
    up to ``EngineConfig.max_batch`` rows); ``batch_tokens``: tokens per batch at most (default: a
    quarter of the page pool); ``step_tokens``: padded tokens per device step at most (default:
    ``register_segments_batch``'s); ``report(line)`` receives each bad record's line (default: stderr)."""
    if engine.tokenizer is None:
        raise ValueError("precompute needs a tokenizer: this model folder has none (tokenizer.json)")
    if batch < 1:
        raise ValueError(f"batch={batch} is invalid: must be >= 1")
    check_tenant(tenant)
    ns = PUBLIC_TENANT if public else tenant
    s = engine.config.page_size
    pool_tokens = (engine.pool.num_pages - 1) * s
    batch_tokens = batch_tokens or max(1, pool_tokens // 4)
    if engine.max_model_len <= pool_tokens:
        limit, limit_why = engine.max_model_len, "the model's maximum length"
    else:
        limit, limit_why = pool_tokens, "the KV page pool"
    registry = engine.persistence.registry if engine.persistence is not None else None
    known = _known_hashes(engine, ns)
    say = report or (lambda line: tqdm.write(line, file=sys.stderr))
    step_kw = {} if step_tokens is None else {"step_tokens": step_tokens}
    res = PrecomputeResult()
    source, parse = open_source(corpus)
    t0 = time.perf_counter()
    bar = tqdm(total=len(source), unit="doc", desc="precompute", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    try:
        tokenize = Tokenize(engine.tokenizer, known, len(engine.bos_prefix), limit, limit_why)
        pipeline = build_pipeline(source, parse, tokenize, batch, batch_tokens, threads or min(8, os.cpu_count() or 1))
        for docs in pipeline:
            todo = []
            for doc in docs:
                if doc.status == "bad":
                    res.bad.append((doc.where, doc.error))
                    say(f"{doc.where}: {doc.error} (skipped)")
                elif doc.status == "unchanged":
                    res.unchanged += 1
                else:
                    todo.append(doc)
            if todo:
                _compute(engine, todo, dict(tenant=tenant, public=public, **step_kw), ns, registry, res, say)
            bar.update(len(docs))
            elapsed = time.perf_counter() - t0
            bar.set_postfix_str(f"{res.tokens / elapsed:.0f} tok/s, {res.computed} computed, "
                                f"{res.unchanged} unchanged, {len(res.bad)} bad", refresh=False)
    finally:
        bar.close()
        source.close()
    res.seconds = time.perf_counter() - t0
    if snapshot and engine.persistence is not None and (res.computed or res.deleted):
        t1 = time.perf_counter()
        res.snapshot = engine.save_snapshot()
        res.snapshot_s = time.perf_counter() - t1
    return res


def _compute(engine, docs: list[Doc], kw: dict, ns: str, registry, res: PrecomputeResult,
             say: Callable[[str], None]) -> None:
    """One batch: skip documents whose stored tokens match, replace changed ones, register the rest
    (``kw``: ``register_segments_batch``'s keyword arguments)."""
    tenant = kw["tenant"]
    items, updates, hashes = [], set(), []
    for doc in docs:
        old = _live(engine, ns, doc.id)
        if old is None:
            items.append(doc)
            continue
        if old.info.tenant != tenant:
            res.bad.append((doc.where, f"segment {doc.id!r} is a public segment of another tenant"))
            say(f"{doc.where}: segment {doc.id!r} is a public segment of another tenant (skipped)")
        elif old.token_ids == doc.tokens:  # stored without a hash (or by the API): same tokens, same KV
            res.unchanged += 1
            hashes.append((ns, doc.id, old.uid, doc.sha))
        else:
            engine.delete_segment(doc.id, tenant=tenant)  # frees the old version's pages
            res.deleted += 1
            updates.add(doc.id)
            items.append(doc)
    done = _register(engine, items, kw, ns, res, say)
    for doc in done:
        res.tokens += len(engine.bos_prefix) + len(doc.tokens)
        if doc.id in updates:
            res.updated += 1
        else:
            res.stored += 1
        hashes.append((ns, doc.id, _live(engine, ns, doc.id).uid, doc.sha))
    if registry is not None and hashes:
        registry.set_segment_meta(HASH_KEY, hashes)


def _register(engine, docs: list[Doc], kw: dict, ns: str, res: PrecomputeResult,
              say: Callable[[str], None]) -> list[Doc]:
    """``register_segments_batch``; if the batch fails, its documents one by one (a failing one is bad)."""
    if not docs:
        return []
    try:
        engine.register_segments_batch([(d.id, d.tokens) for d in docs], **kw)
        return docs
    except Exception as err:  # noqa: BLE001 - isolate the failing document(s) below
        if len(docs) == 1:
            res.bad.append((docs[0].where, f"{type(err).__name__}: {err}"))
            say(f"{docs[0].where}: {type(err).__name__}: {err} (skipped)")
            return []
        log.warning("a batch of %d documents failed (%s: %s); retrying them one by one", len(docs),
                    type(err).__name__, err)
    done = []
    for doc in docs:
        if _live(engine, ns, doc.id) is not None:
            done.append(doc)  # registered before the batch failed
        else:
            done += _register(engine, [doc], kw, ns, res, say)
    return done
