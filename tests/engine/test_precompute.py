"""Bulk precompute (``inferscale_jax/precompute.py``, ``Engine.register_segments_batch``): a generated
corpus of 200 documents with 3 bad lines; batched KV equals one-by-one KV; resume; new versions;
bad records of every kind; folder corpora; the CLI; CPU throughput batched vs one by one."""

import dataclasses
import json
import random
from importlib import resources

import jax
import numpy as np
import pytest

from inferscale_jax import Engine, EngineConfig, SegmentExists
from inferscale_cli.main import main as cli_main
from inferscale_jax.default_model import default_model_dir
from inferscale_jax.precompute import HASH_KEY, length_bucket, precompute
from inferscale_jax.tokenizer import load_tokenizer
from models import init_params
from tests.support.tiny_engine import CFG as TINY, assert_only_nodes_hold_pages

CFG = dataclasses.replace(TINY, vocab_size=1024)  # the default tokenizer's vocabulary
PAGE = 16
BAD = {31: "missing field 'text'", 97: "empty text", 164: "invalid JSON"}  # line -> reason (prefix)
# fp32, |diff| <= 1e-5 * max|K/V| (values reach ~12 here): steps of other shapes reduce in another order, so
# K/V past layer 0 differ by ~20 ulp -- as much as the one-by-one path differs from itself between
# prefill_chunk=16 and 64 (2.2e-5 measured); a wrong position or missing context differs by O(1)
TOL = 1e-5
WORDS = resources.files("inferscale_jax").joinpath("data/corpus.txt").read_text(encoding="utf-8").split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_model_dir(str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


def make_engine(tok, snapshot_dir=None, **kw):
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    config = dict(dtype="float32", page_size=PAGE, hbm_pages=2048, prefill_chunk=64, max_batch=64,
                  min_table_pages=16, snapshot_dir=snapshot_dir, max_num_batched_tokens=2048)
    engine = Engine(params, CFG, tok, EngineConfig(**{**config, **kw}), fingerprint="precompute-test")
    engine.debug_checks = True
    return engine


def text_of(rng, n_words):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def write_corpus(path, docs: dict[str, str], bad: dict[int, str] | None = None) -> None:
    """One JSON line per document; ``bad`` puts a bad line at each given line number."""
    bad_lines = {"missing field 'text'": json.dumps({"id": "no-text"}),
                 "empty text": json.dumps({"id": "empty", "text": ""}),
                 "invalid JSON": '{"id": "broken", "text": "unterminated'}
    items = iter(docs.items())
    lines, total = [], len(docs) + len(bad or {})
    for number in range(1, total + 1):
        if bad and number in bad:
            lines.append(bad_lines[bad[number]])
        else:
            sid, text = next(items)
            lines.append(json.dumps({"id": sid, "text": text}))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def make_docs(seed=0, n=200):
    rng = random.Random(seed)
    # mostly short documents, a few longer than several 64-token chunks
    return {f"doc-{i:03d}": text_of(rng, rng.choice([rng.randint(1, 12), rng.randint(10, 60), rng.randint(60, 140)]))
            for i in range(n)}


def root_kv(engine, sid, tenant="default"):
    """[L, 2, Hkv, n, D]: K and V of every token of the segment's root node, read from its pages."""
    node = engine.store.node([engine.store.resolve(sid, tenant)])
    pages = np.asarray(node.pages)
    out = []
    for k, v in zip(engine.runner.cache.k, engine.runner.cache.v):
        kv = np.stack([np.asarray(k[:, pages]), np.asarray(v[:, pages])])  # [2, Hkv, np, S, D]
        out.append(kv.reshape(2, kv.shape[1], -1, kv.shape[-1])[:, :, :node.num_tokens])
    return np.stack(out)


def assert_kv_equal(got, want, what):
    assert got.shape == want.shape, what
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * np.abs(want).max(), err_msg=what)


def spy_steps(engine):
    calls = []
    orig = engine.runner.step
    engine.runner.step = lambda rows, *a: (calls.append([len(r.tokens) for r in rows]), orig(rows, *a))[1]
    return calls


def test_corpus_batched_kv_resume_and_new_version(tmp_path, tok):
    docs = make_docs()
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, docs, BAD)
    snap = str(tmp_path / "snap")
    e = make_engine(tok, snap)
    calls = spy_steps(e)
    reported = []
    res = precompute(e, str(corpus), progress=False, report=reported.append)
    # every good document is a segment with the tokenizer's ids; the bad lines are reported by number
    assert (res.stored, res.updated, res.unchanged) == (200, 0, 0)
    assert [w for w, _ in sorted(res.bad, key=lambda b: int(b[0].split()[1]))] == [f"line {n}" for n in BAD]
    for where, why in res.bad:
        assert why.startswith(BAD[int(where.split()[1])])
    assert sorted(line.split(":")[0] for line in reported) == sorted(f"line {n}" for n in BAD)
    ids = {sid: tok.encode(text, add_special_tokens=False) for sid, text in docs.items()}
    assert res.tokens == sum(len(x) for x in ids.values())
    assert {s.id: s.num_tokens for s in e.list_segments()} == {sid: len(x) for sid, x in ids.items()}
    assert all(e.store.resolve(sid, "default").token_ids == x for sid, x in ids.items())
    assert max(len(c) for c in calls) > 32 and len(calls) < 40  # many documents per device step
    assert res.snapshot["segments"] == 200
    e.check_invariants()
    assert_only_nodes_hold_pages(e)

    # KV of a sample of documents of different lengths == each registered alone (fp32)
    ref = make_engine(tok)
    by_len = sorted(ids, key=lambda s: len(ids[s]))
    sample = [by_len[i] for i in np.linspace(0, len(by_len) - 1, 10).astype(int)]
    assert len({len(ids[s]) for s in sample}) >= 8 and len(ids[sample[-1]]) > 2 * 64  # several chunks
    for sid in sample:
        ref.register_segment(sid, text=docs[sid])
        want, got = root_kv(ref, sid), root_kv(e, sid)
        assert got.shape == want.shape == (CFG.num_layers, 2, CFG.num_kv_heads, len(ids[sid]), CFG.head_dim)
        assert_kv_equal(got, want, sid)
    e.close()

    # a second run (a new process would do the same: restore, then precompute) computes nothing
    e = make_engine(tok, snap)
    assert len(e.list_segments()) == 200
    calls = spy_steps(e)
    res = precompute(e, str(corpus), progress=False, report=lambda line: None)
    assert (res.stored, res.updated, res.unchanged, len(res.bad), res.tokens) == (0, 0, 200, 3, 0)
    assert calls == []

    # an edited document becomes a new version (old pages freed); a new document is stored
    victim = sample[5]
    old = e.store.resolve(victim, "default")
    old_node = e.store.node([old])
    assert old_node is not None
    old_pages = list(old_node.pages)
    docs2 = dict(docs)
    docs2[victim] = "Changed: " + docs[victim]  # no prefix in common with the old version
    docs2["doc-new"] = "a brand new document"
    write_corpus(corpus, docs2, BAD)
    res = precompute(e, str(corpus), progress=False, report=lambda line: None)
    assert (res.stored, res.updated, res.unchanged, len(res.bad)) == (1, 1, 199, 3)
    new = e.store.resolve(victim, "default")
    assert new.uid != old.uid and new.token_ids == tok.encode(docs2[victim], add_special_tokens=False)
    assert new.token_ids != old.token_ids
    assert e.store.node([old]) is None and e.segment_tier(victim) == "hbm"
    for p in old_pages:  # freed: each old page is free or was handed to a live node (say doc-new's)
        assert e.pool.refcount(p) == sum(p in n.pages for n in e.store.nodes())
    assert sum(e.pool.refcount(p) == 0 for p in old_pages) >= len(old_pages) - 1  # all but a reused one
    assert not set(old_pages) & set(e.store.node([new]).pages)
    assert_only_nodes_hold_pages(e)
    ref.register_segment("v2", text=docs2[victim])
    assert_kv_equal(root_kv(e, victim), root_kv(ref, "v2"), victim)
    # an appended edit: the new version shares the unchanged full pages (prefix cache), computes the rest
    full = list(e.store.node([new]).pages[:len(new.token_ids) // PAGE])
    docs2[victim] += " and one more sentence at the end."
    write_corpus(corpus, docs2, BAD)
    calls.clear()
    res = precompute(e, str(corpus), progress=False, report=lambda line: None)
    assert (res.updated, res.unchanged) == (1, 200)
    newer = e.store.resolve(victim, "default")
    assert e.store.node([newer]).pages[:len(full)] == full and sum(map(sum, calls)) < len(newer.token_ids)
    ref.register_segment("v3", text=docs2[victim])
    assert_kv_equal(root_kv(e, victim), root_kv(ref, "v3"), victim)
    # the hashes are durable: the registry holds exactly one live hash per document
    meta = e.persistence.registry.segment_meta(HASH_KEY)
    assert len(meta) == 201 and meta[("default", victim)][0] == newer.uid
    e.close()
    e = make_engine(tok, snap)
    res = precompute(e, str(corpus), progress=False, report=lambda line: None)
    assert (res.computed, res.unchanged) == (0, 201)
    e.close()


def test_bad_records_of_every_kind_and_no_registry(tmp_path, tok):
    lines = [json.dumps({"id": "ok-1", "text": "first document"}),
             json.dumps({"id": 7, "text": "an integer id is its decimal string"}),
             json.dumps({"text": "no id"}),
             json.dumps({"id": "num", "text": 42}),
             json.dumps(["not", "an", "object"]),
             "",  # blank lines are ignored
             json.dumps({"id": "", "text": "empty id"}),
             json.dumps({"id": "ws", "text": "   \n\t"}),
             json.dumps({"id": "long", "text": text_of(random.Random(1), 600)}),  # > 512 positions
             json.dumps({"id": "ok-1", "text": "a duplicate id, different text"}),
             json.dumps({"id": "ok-2", "text": "second document"})]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    e = make_engine(tok)  # no snapshot_dir: resume by comparing token ids
    res = precompute(e, str(corpus), progress=False, report=lambda line: None)
    bad = dict(res.bad)
    assert res.stored == 3 and sorted(s.id for s in e.list_segments()) == ["7", "ok-1", "ok-2"]
    assert bad.keys() == {"line 3", "line 4", "line 5", "line 7", "line 8", "line 9", "line 10"}
    assert "missing field 'id'" in bad["line 3"]
    assert "'text' must be a string, got int" in bad["line 4"]
    assert "JSON object" in bad["line 5"]
    assert "'id' must be a non-empty string" in bad["line 7"]
    assert bad["line 8"] == "empty text"
    assert "exceed the model's maximum length (512)" in bad["line 9"]
    assert bad["line 10"] == "duplicate id 'ok-1' (first at line 1)"
    assert e.store.resolve("ok-1", "default").token_ids == tok.encode("first document", add_special_tokens=False)
    res = precompute(e, str(corpus), progress=False, report=lambda line: None)
    assert (res.computed, res.unchanged, len(res.bad)) == (0, 3, 7)
    # public segments, and the engine method's own checks (nothing registered on failure)
    res = precompute(e, str(corpus), tenant="acme", public=True, progress=False, report=lambda line: None)
    assert res.stored == 3 and {s.id for s in e.list_segments("other") if s.public} == {"7", "ok-1", "ok-2"}
    before = e.stats()["pages_used"]
    with pytest.raises(SegmentExists):
        e.register_segments_batch([("fresh", [5, 6]), ("ok-2", [1, 2])])
    with pytest.raises(ValueError, match="appears twice"):
        e.register_segments_batch([("x", [5, 6]), ("x", [1, 2])])
    assert e.stats()["pages_used"] == before and "fresh" not in {s.id for s in e.list_segments()}


def test_folder_corpus(tmp_path, tok):
    root = tmp_path / "docs"
    (root / "faq").mkdir(parents=True)
    (root / "a.txt").write_text("alpha document")
    (root / "faq" / "b.md").write_text("# FAQ\nwarranty is two years")
    (root / "faq" / "empty.md").write_text("")
    (root / "bad.txt").write_bytes(b"\xff\xfe not utf-8 \xc3")
    (root / "ignored.json").write_text("{}")
    e = make_engine(tok)
    res = precompute(e, str(root), progress=False, report=lambda line: None)
    assert sorted(s.id for s in e.list_segments()) == ["a.txt", "faq/b.md"]
    assert dict(res.bad).keys() == {"bad.txt", "faq/empty.md"} and "not UTF-8" in dict(res.bad)["bad.txt"]
    assert e.store.resolve("faq/b.md", "default").token_ids == tok.encode("# FAQ\nwarranty is two years",
                                                                          add_special_tokens=False)


def test_length_buckets_and_pool_pressure(tmp_path, tok):
    assert [length_bucket(n) for n in (1, 16, 17, 20, 21, 32, 33, 40, 41, 100)] == [16, 16, 20, 20, 24, 32, 40, 40,
                                                                                     48, 112]
    # a pool smaller than one batch: documents are computed in parts, earlier ones demoted to host
    rng = random.Random(3)
    docs = {f"d{i}": text_of(rng, 40) for i in range(24)}
    write_corpus(tmp_path / "c.jsonl", docs)
    e = make_engine(tok, hbm_pages=1 + 48, host_pages=1000)
    calls = spy_steps(e)
    res = precompute(e, str(tmp_path / "c.jsonl"), batch_tokens=10**6, progress=False, report=lambda line: None)
    assert res.stored == 24 and not res.bad
    assert e.tiers.stats()["host"]["segments"] > 0 and max(len(c) for c in calls) < 24  # in parts
    e.check_invariants()
    ref = make_engine(tok)
    for sid in ("d0", "d23"):
        if e.segment_tier(sid) != "hbm":
            e.kv.promote(e.store.resolve(sid, "default"))
        ref.register_segment(sid, text=docs[sid])
        assert_kv_equal(root_kv(e, sid), root_kv(ref, sid), sid)


def test_a_batch_warmup_covers_every_precompute_step(tmp_path, tok):
    """``warmup(serving=False)`` compiles the buckets of segment registration only (no log-probs,
    no cascade), and a precompute of documents of every length then compiles nothing more."""
    e = make_engine(tok, max_num_batched_tokens=256)
    w = e.warmup(serving=False, buckets="all")  # every bucket (the CPU's default set is the small one)
    keys = [key for key, _, _ in e.runner.executables]
    assert w["buckets"] == len(keys) > 0 and not any(k.num_logprobs or k.shared for k in keys)
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, make_docs(seed=3, n=60))
    res = precompute(e, str(corpus), progress=False, report=lambda line: None)
    assert res.stored == 60 and not res.bad
    assert e.stats()["compiles_after_warmup"] == 0


def test_cli_precompute_default_model(tmp_path, model_dir, capsys):
    docs = {f"kb/{i}": text_of(random.Random(i), 5 + 7 * i) for i in range(6)}
    write_corpus(tmp_path / "kb.jsonl", docs, {4: "invalid JSON"})
    argv = ["precompute", str(tmp_path / "kb.jsonl"), "--model", model_dir, "--snapshot-dir", str(tmp_path / "s"),
            "--dtype", "float32", "--batch", "8", "--tenant", "acme"]
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    assert "6 stored, 0 skipped unchanged, 0 updated, 1 bad" in out and "tokens/s" in out
    assert "line 4: invalid JSON" in err
    assert cli_main(argv) == 0
    out, _ = capsys.readouterr()
    assert "0 stored, 6 skipped unchanged, 0 updated, 1 bad" in out
    with Engine.from_pretrained(model_dir, EngineConfig(dtype="float32", snapshot_dir=str(tmp_path / "s"))) as e:
        assert sorted(s.id for s in e.list_segments("acme")) == sorted(docs)
        assert e.stats()["snapshot"]["recomputed"] == 0  # every segment's KV came from the snapshot
