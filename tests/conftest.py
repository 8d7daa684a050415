import os

# Tests run offline: nothing may be downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# fp32 tests mean fp32: on a GPU XLA's default matmul precision is TF32 (10-bit mantissa), which
# turns 1e-7 differences (a reordered sum) into 1e-3 ones.  A no-op on the CPU.
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# The long subprocess-driven files run last: the soak and the 4-device tensor-parallel child.
_LAST = ("test_soak.py", "test_tensor_parallel.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: os.path.basename(str(item.path)) in _LAST)


# Every compiled CPU executable stays mapped while anything references it (jit caches, engines),
# each in several memory mappings.  One pytest process over the whole suite reached Linux's limit
# of 65530 mappings per process (vm.max_map_count) about 23 minutes in, and the next executable
# loaded segfaulted inside XLA (seen as a crash in JAX's compilation-cache read).  So after each
# test file its engines are collected and JAX's caches cleared: the count stays near one file's.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the file's module-scoped fixtures are finalized in here
    if nextitem is None or nextitem.path != item.path:
        import gc

        gc.collect()
        jax.clear_caches()
        gc.collect()
