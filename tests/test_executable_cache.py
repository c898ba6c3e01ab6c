"""`ExecutableCache` keys: an uncommitted array is not a committed one on the same device. A program lowered for
committed inputs makes committed results, so sharing its entry made an uncommitted caller's results refuse to
meet arrays on other devices later (the blockwise backward's zero sums beside K/V on a 2-device mesh, after an
earlier test had compiled the zero sums for committed weights)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.rollout.executor import ExecutableCache, abstract, out_abstract

DOUBLE = jax.jit(lambda x: x * 2)
ADD = jax.jit(lambda a, b: a + b)


def test_uncommitted_inputs_get_their_own_program_and_uncommitted_results():
    cache = ExecutableCache(use_store=False)
    x = jnp.arange(4.0)
    on_mesh = jax.device_put(jnp.ones(4), NamedSharding(jax.make_mesh((2,), ("d",), devices=jax.devices()[:2]),
                                                        PartitionSpec()))
    committed = cache("double", DOUBLE, jax.device_put(x, jax.devices()[0]))
    assert committed.committed
    with pytest.raises(ValueError, match="incompatible devices"):
        ADD(committed, on_mesh)
    out = cache("double", DOUBLE, x)
    assert not out.committed and cache.compiles == 2
    assert (ADD(out, on_mesh) == 2 * x + 1).all()          # goes to the mesh's devices


def test_abstract_inputs_and_results_key_as_the_arrays_do():
    cache = ExecutableCache(use_store=False)
    x, placed = jnp.arange(4.0), jax.device_put(jnp.arange(4.0), jax.devices()[1])
    for arr in (x, placed):
        assert cache.key("double", abstract(arr)) == cache.key("double", arr)
        exe = cache.compile("double", DOUBLE, abstract(arr))
        assert cache.key("x", out_abstract(exe)) == cache.key("x", cache("double", DOUBLE, arr))
    assert cache.compiles == 2                            # the calls found what the abstract inputs compiled
