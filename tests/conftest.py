"""Test set-up: 8 fake CPU devices, configured before JAX initialises its backends."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
