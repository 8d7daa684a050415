"""Host-side habits of the engine that keep per-step overhead low (no timing asserted here)."""

import gc

from tiny_engine import make_engine


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
