"""Test cases of the kernels, shared by `tests/` and `scripts/` (which must not import `tests/`)."""
