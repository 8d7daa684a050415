"""Several processes or devices: jax.distributed, the engine core process, tensor parallel."""
