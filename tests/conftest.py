import fcntl
import os
import tempfile

# Tests run offline: nothing may be downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# fp32 tests mean fp32: on a GPU XLA's default matmul precision is TF32 (10-bit mantissa), which
# turns 1e-7 differences (a reordered sum) into 1e-3 ones.  A no-op on the CPU.
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# On a CPU-only machine (no CUDA plugin: CI's, the developers') the test processes compile at LLVM's lowest
# optimization level.  Most of the suite's time is compiling (the Pallas kernels in interpret mode, each engine's
# step buckets; one kernel test: 40 of its 57 s), and the tiny shapes run about as fast either way:
# tests/engine/test_decode_loop.py alone 185 -> 67 s.  XLA reads XLA_FLAGS once, at the process's first compile, so
# the flag is set for that compile and taken back: the processes the tests start (servers, the tensor-parallel and
# journal children) compile and run as users' do, at XLA's default level (a time-bounded server test ran ~2x
# slower at the lowest level, and the 4-device tensor-parallel child 1.4x); a child whose log-probs are compared
# with the test's own to 1e-6 takes the flag too (``tests.support.same_compiler``).  On a GPU host nothing changes.
def _test_processes_compile_fast() -> None:
    import importlib.util

    flags = os.environ.get("XLA_FLAGS")
    if any(importlib.util.find_spec(p) for p in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins")) or (
            "xla_backend_optimization_level" in (flags or "")):
        return
    os.environ["INFERSCALE_TEST_XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # (tests.support.same_compiler)
    os.environ["XLA_FLAGS"] = ((flags or "") + " " + os.environ["INFERSCALE_TEST_XLA_FLAGS"]).strip()
    try:
        jax.jit(lambda x: x + 1)(1).block_until_ready()  # (the first compile: XLA parses its flags here)
    finally:
        if flags is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = flags


_test_processes_compile_fast()


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


# The suite runs on two workers (pytest-xdist, the README's test command), and the machines it runs on
# have two cores.  A test marked ``alone`` bounds a latency or a duration; while one runs, the other
# worker starts no test (it finishes the one it is in): every test holds a shared lock on one file
# per run, an ``alone`` test an exclusive one.  Without xdist this does nothing.
def pytest_configure(config):
    config.addinivalue_line("markers", "alone: bounds a time; under pytest-xdist no other test runs beside it")


@pytest.fixture(autouse=True)
def _alone_under_xdist(request):
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    with open(os.path.join(tempfile.gettempdir(), f"inferscale-tests-{run}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
