import os
import sys

# Tests run offline: nothing may be downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

# fp32 tests mean fp32: on a GPU XLA's default matmul precision is TF32 (10-bit mantissa), which
# turns 1e-7 differences (a reordered sum) into 1e-3 ones.  A no-op on the CPU.
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
