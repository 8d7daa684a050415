"""The Pallas kernels (interpret mode on the CPU) against their references."""
