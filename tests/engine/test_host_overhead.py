"""Host-side habits of the engine that keep per-step overhead low (no timing asserted here)."""

import gc

from tests.support.tiny_engine import make_engine


def test_engine_freezes_its_long_lived_heap():
    """After construction (and after each compile) the live heap is frozen out of the cyclic
    GC's generations, so a full collection does not walk it in the middle of serving."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    engine = make_engine(pages=32)
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
    engine.generate(prompt_token_ids=[1, 2, 3])  # compiles a new step bucket
    assert gc.get_freeze_count() > 0


def test_a_dropped_engine_is_freed_without_the_cyclic_gc():
    """Frozen objects are only freed by reference counting, so the engine must not sit in a
    reference cycle (its parts hold it through weak proxies): else every engine ever built in a
    process - and its KV pool - would live forever."""
    import weakref

    engine = make_engine(pages=32)
    engine.generate(prompt_token_ids=[1, 2, 3])
    ref = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert ref() is None
    finally:
        gc.enable()
