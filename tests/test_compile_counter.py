"""CompileCounter counts the XLA compilations JAX performs (its monitoring events), and nothing else."""

import jax
import jax.numpy as jnp

from jaxrl.runtime import CompileCounter


def test_counts_new_executables_only():
    a, c = jnp.ones(7), jnp.ones(9)                             # inputs first (creating them compiles)
    b = a * 2
    counter = CompileCounter()
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    f(a).block_until_ready()
    first = counter.take()
    assert first["compiles"] >= 1 and first["compile_s"] > 0
    f(b).block_until_ready()                                    # same shape: the cached executable
    assert counter.take()["compiles"] == 0
    f(c).block_until_ready()                                    # a new shape is a new executable
    assert counter.take()["compiles"] >= 1
    jax.jit(lambda x: x - 1).lower(jnp.ones(3)).compile()       # AOT compiles count too
    assert counter.take()["compiles"] >= 1
    other = CompileCounter()                                    # counters are independent views
    jax.jit(lambda x: x * 5).lower(jnp.ones(4)).compile()
    assert other.take()["compiles"] >= 1 and counter.take()["compiles"] >= 1
