"""`jaxrl.executable_store`: the rollout's executables loaded from disk by their inputs' key, without tracing or
lowering, give the bits the compiled ones give: on a TP2 x 2 layout (the second instance loads what the first
compiled, mapped onto its own devices), in a fresh in-memory cache (everything loaded, nothing traced), after
a corrupted file (removed and compiled again), and in each process of a 2-process job loading what one process
stored, also where it loaded them from JAX's persistent cache. The key: device-free, and every input, static argument and setting it must tell apart."""

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from jax._src import monitoring
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.executable_store import ExecutableStore, max_bytes_from_env
from jaxrl.rollout import SamplingParams, generate, model_step
from jaxrl.rollout.executor import CACHE, padding_batch, decode_inputs
from models import PRESETS, init
from tests.train_runs import ROOT, _env

CFG = PRESETS["tiny-qwen3"]
SERVICE = dict(page_size=8, num_pages=64)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20, seed=3)


@pytest.fixture(scope="module")
def weights():
    return init(jax.random.key(0), CFG)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in (3, 9, 16, 5)]


class Traces:
    """The functions named `names` JAX traced inside this context (the listener is removed on leaving it)."""

    def __init__(self, names=("decode_step", "prefill_step")):
        self.names, self.watched = [], names

    def __enter__(self):
        monitoring.register_event_duration_secs_listener(self._on)
        return self

    def __exit__(self, *exc):
        monitoring.unregister_event_duration_listener(self._on)

    def _on(self, event, duration, fun_name="?", **_):
        if event == "/jax/core/compile/jaxpr_trace_duration" and fun_name in self.watched:
            self.names.append(fun_name)


def _run(weights, prompts, **kw):
    outs = generate(CFG, weights, prompts, SAMPLED, tp=2, instances=2, **SERVICE, **kw)
    return [(o.tokens, np.asarray(o.logprobs).tobytes()) for o in outs]


@pytest.fixture
def store(tmp_path, monkeypatch):
    s = ExecutableStore(tmp_path / "executables")
    monkeypatch.setattr(ExecutableStore, "default", classmethod(lambda cls: s))
    CACHE.clear()
    yield s
    CACHE.clear()


@pytest.fixture(scope="module")
def reference(weights, prompts):
    """The same generation compiled as before the store (no file read or written)."""
    CACHE.clear()
    CACHE.use_store = False
    try:
        return _run(weights, prompts)
    finally:
        CACHE.use_store = True
        CACHE.clear()


def test_loaded_executables_give_the_compiled_bits(weights, prompts, reference, store):
    before = (CACHE.compiles, CACHE.loads)
    assert _run(weights, prompts) == reference
    built, loaded = CACHE.compiles - before[0], CACHE.loads - before[1]
    files = sorted(store.directory.glob("*.exe"))
    # instance 1 (devices 2-3) loads each program instance 0 (devices 0-1) compiled and stored
    assert loaded > 0 and len(files) == built - loaded
    CACHE.clear()                                  # a fresh process's view: nothing in memory
    before = (CACHE.compiles, CACHE.loads)
    with Traces() as traces:
        assert _run(weights, prompts) == reference
    assert CACHE.compiles - before[0] == CACHE.loads - before[1] == built
    assert traces.names == []                       # loaded without tracing (nor lowering)
    assert sorted(store.directory.glob("*.exe")) == files


def test_a_corrupted_file_is_removed_and_compiled_again(weights, prompts, reference, store, caplog):
    _run(weights, prompts)
    files = sorted(store.directory.glob("*.exe"))
    files[0].write_bytes(b"not an executable")
    files[1].write_bytes(files[1].read_bytes()[:100])          # cut short
    CACHE.clear()
    before = (CACHE.compiles, CACHE.loads)
    with caplog.at_level(logging.WARNING, logger="jaxrl.executable_store"):
        assert _run(weights, prompts) == reference
    assert sum("unreadable" in r.message for r in caplog.records) == 2
    assert (CACHE.compiles - before[0]) - (CACHE.loads - before[1]) == 2         # the two compiled again
    assert sorted(store.directory.glob("*.exe")) == files       # written again, whole
    CACHE.clear()
    before = (CACHE.compiles, CACHE.loads)
    assert _run(weights, prompts) == reference
    assert CACHE.compiles - before[0] == CACHE.loads - before[1]


def test_a_load_marks_its_file_used_and_a_save_past_the_bound_removes_the_least_recently_used(
        weights, prompts, reference, store, tmp_path, caplog):
    _run(weights, prompts)
    files = sorted(store.directory.glob("*.exe"))
    assert files
    for f in files:
        os.utime(f, (1e9, 1e9))                                 # long unused
    CACHE.clear()
    assert _run(weights, prompts) == reference                  # every program loaded: each file marked used
    assert all(f.stat().st_mtime > time.time() - 600 for f in files)

    bounded = ExecutableStore(tmp_path / "bounded", max_bytes=1000)
    bounded.directory.mkdir()
    paths = [bounded.directory / f"{name}.exe" for name in "abcd"]
    for i, p in enumerate(paths[:3]):
        p.write_bytes(bytes(300))
        os.utime(p, (1e9 + i, 1e9 + i))
    bounded.added(paths[2])                                     # counted: 900 bytes, within the bound
    assert all(p.exists() for p in paths[:3])
    os.utime(paths[0])                                          # a loaded: now the most recently used
    paths[3].write_bytes(bytes(300))
    os.utime(paths[3], (1e9 - 1, 1e9 - 1))                      # the oldest time, but the file just written
    with caplog.at_level(logging.INFO, logger="jaxrl.executable_store"):
        bounded.added(paths[3])                                 # 1200 > 1000: trimmed to 90%, oldest first
    assert [p.exists() for p in paths] == [True, False, True, True]
    assert any("removed the 1 least recently used" in r.message for r in caplog.records)


def test_saves_past_the_bound_trim_the_store(weights, prompts, reference, store, tmp_path, monkeypatch, caplog):
    _run(weights, prompts)
    sizes = [f.stat().st_size for f in store.directory.glob("*.exe")]
    assert len(sizes) >= 2                                      # (the decode and prefill steps)
    bounded = ExecutableStore(tmp_path / "bounded", max_bytes=int(1.1 * max(sizes)))   # any one of them, not all
    monkeypatch.setattr(ExecutableStore, "default", classmethod(lambda cls: bounded))
    CACHE.clear()
    with caplog.at_level(logging.INFO, logger="jaxrl.executable_store"):
        assert _run(weights, prompts) == reference              # every program saved again, into the bounded store
    left = [f.stat().st_size for f in bounded.directory.glob("*.exe")]
    assert 0 < len(left) < len(sizes) and sum(left) <= bounded.max_bytes
    assert any("least recently used" in r.message for r in caplog.records)


@pytest.mark.parametrize("value,gb", [(None, 2.0), ("0.5", 0.5), ("0", None), ("-1", None), ("lots", None),
                                      ("inf", None), ("nan", None)])
def test_the_bound_comes_from_the_environment(monkeypatch, value, gb):
    if value is None:
        monkeypatch.delenv("JAXRL_EXECUTABLE_STORE_MAX_GB", raising=False)
    else:
        monkeypatch.setenv("JAXRL_EXECUTABLE_STORE_MAX_GB", value)
    if gb is None:
        with pytest.raises(ValueError, match="JAXRL_EXECUTABLE_STORE_MAX_GB.*positive number"):
            max_bytes_from_env()
    else:
        assert max_bytes_from_env() == int(gb * 2**30)


def test_a_program_jax_loaded_is_not_stored_when_its_bytes_cannot_be_told_apart(tmp_path):
    """The bytes of an executable JAX's cache loaded are found by the object's id, checked by its fingerprint; XLA:CPU
    gives a program without inputs an empty one, so an id reused by such a program (seen: a stale entry's
    28-output program stored for a 19-output one) is not stored; a fresh program with a fingerprint is, also under
    a stale entry (its fingerprint tells it apart: two clean-clone suite runs kept one of the rollout's programs
    from the store that way, and the count checks above failed). A program without a fingerprint under a stale
    entry is not stored either (given the stale entry's bytes, the blockwise backward's `_zero_acc` crashed)."""
    from jaxrl import serialized_executable

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    x = jax.device_put(np.ones(3, np.float32), NamedSharding(mesh, PartitionSpec()))
    no_inputs = jax.jit(jax.numpy.zeros_like).lower(x).compile()   # x unused: pruned
    assert no_inputs.runtime_executable().fingerprint == b""
    store = ExecutableStore(tmp_path)
    entry = store.entry("decode", model_step.decode_step, (x,), {"cfg": CFG, "impl": "xla"})
    table = serialized_executable.FROM_JAX_CACHE
    for noted in (b"", b"another program's fingerprint"):       # its own entry, or a stale one: cannot tell
        table[id(no_inputs.runtime_executable())] = (noted, "a key of another program")
        try:
            with pytest.raises(ValueError, match="cannot tell"):
                serialized_executable.jax_cache_bytes(no_inputs.runtime_executable())
            assert entry.save(no_inputs) is False and not list(tmp_path.glob("*.exe"))
        finally:
            table.pop(id(no_inputs.runtime_executable()), None)
    assert entry.save(no_inputs) is True                        # unknown to JAX's cache: serialised itself
    # a stale entry (a freed program's id reused) under a program with a fingerprint: compiled here, stored
    sin = jax.jit(jax.numpy.sin).lower(x).compile()
    table[id(sin.runtime_executable())] = (b"another program's fingerprint", "a key of another program")
    try:
        assert entry.save(sin) is True and id(sin.runtime_executable()) not in table
    finally:
        table.pop(id(sin.runtime_executable()), None)
    np.testing.assert_array_equal(entry.load()(x), sin(x))                    # loads, the same bits


def _decode_args(weights, devices, pages=4, rows=2, truncate=False):
    mesh = Mesh(np.array(devices).reshape(1, -1), ("fsdp", "tp"))
    rep = NamedSharding(mesh, PartitionSpec())
    abstract = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=rep)  # noqa: E731
    w = jax.tree.map(abstract, weights)
    kv = jax.ShapeDtypeStruct((CFG.num_layers, 16, CFG.num_kv_heads, 8, CFG.head_dim), np.float32,
                              sharding=NamedSharding(mesh, PartitionSpec(None, None, "tp")))
    prev = abstract(np.zeros(8, np.int32))
    return decode_inputs(w, kv, kv, prev, padding_batch(rows, pages, truncate), abstract)


def test_the_key_is_device_free_and_tells_every_input_apart(weights, tmp_path):
    store, devs = ExecutableStore(tmp_path), jax.devices()
    path = lambda args, fn=model_step.decode_step, **static: store.entry("decode", fn, args, static).path  # noqa: E731
    base = path(_decode_args(weights, devs[0:2]), cfg=CFG, impl="xla")
    assert path(_decode_args(weights, devs[2:4]), cfg=CFG, impl="xla") == base        # other devices
    assert path(_decode_args(weights, [devs[5], devs[4]]), cfg=CFG, impl="xla") == base
    others = [path(_decode_args(weights, devs[0:4]), cfg=CFG, impl="xla"),              # a wider mesh
              path(_decode_args(weights, devs[0:2], pages=5), cfg=CFG, impl="xla"),     # a shape
              path(_decode_args(weights, devs[0:2], truncate=True), cfg=CFG, impl="xla"),  # static pytree data
              path(_decode_args(weights, devs[0:2]), cfg=dataclasses.replace(CFG, rms_norm_eps=1e-5), impl="xla"),
              path(_decode_args(weights, devs[0:2]), cfg=CFG, impl="pallas")]
    with jax.default_matmul_precision("float32"):                                       # a thread's setting
        others.append(path(_decode_args(weights, devs[0:2]), cfg=CFG, impl="xla"))
    assert len({base, *others}) == 1 + len(others)
    # not storable: a closure (its program depends on what it closes over), an input without a mesh
    closure = jax.jit(lambda x: x + 1)
    assert store.entry("f", closure, (jax.ShapeDtypeStruct((2,), np.float32, sharding=NamedSharding(
        Mesh(np.array(devs[:1]), ("tp",)), PartitionSpec())),), {}) is None
    assert store.entry("decode", model_step.decode_step, (np.zeros(2),), {"cfg": CFG}) is None
    assert store.entry("decode", model_step.decode_step, _decode_args(weights, devs[0:2]),
                       {"cfg": CFG, "impl": object()}) is None


def test_the_train_side_keys(weights, tmp_path):
    """A partial of a module-level function is keyed by its bound arguments and the jit's options; an optimizer
    by the config `make_optimizer` made it from; a sharding static argument by its spec on the inputs' mesh."""
    import functools

    import optax

    from jaxrl.config.train import OptimSection
    from jaxrl.train import step
    from jaxrl.train.optim import make_optimizer

    store, devs = ExecutableStore(tmp_path), jax.devices()
    mesh = Mesh(np.array(devs[:2]).reshape(1, 2), ("fsdp", "tp"))
    x = (jax.ShapeDtypeStruct((4, 8), np.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "tp"))), 1.0)
    path = lambda fn, args=x, **static: getattr(store.entry("f", fn, args, static), "path", None)  # noqa: E731
    spec = step.LossSpec()
    grads = path(step.make_grad_step(CFG, spec))
    assert grads is not None and grads == path(step.make_grad_step(CFG, step.LossSpec()))
    assert grads != path(step.make_grad_step(CFG, dataclasses.replace(spec, clip_high=0.3)))
    assert grads != path(jax.jit(functools.partial(step._grads, cfg=CFG, spec=spec)))          # no donation
    tx = lambda **kw: make_optimizer(OptimSection(**kw), 10)[0]  # noqa: E731
    update = path(step.make_apply_update(tx(lr=1e-3)))
    assert update is not None and update == path(step.make_apply_update(tx(lr=1e-3)))
    assert update != path(step.make_apply_update(tx(lr=2e-3)))
    assert update != path(step.make_apply_update(make_optimizer(OptimSection(lr=1e-3), 11)[0]))
    assert path(step.make_apply_update(optax.adam(1e-3))) is None          # not made from a config
    assert path(jax.jit(step._grads, static_argnames=("cfg", "spec"), out_shardings=NamedSharding(mesh, PartitionSpec())),
                cfg=CFG, spec=spec) is None                                # a jit that places its outputs
    zeros = jax.jit(lambda a, *, sharding: a, static_argnames=("sharding",))
    assert path(zeros, sharding=NamedSharding(mesh, PartitionSpec())) is None          # (a closure)
    from jaxrl.train.blockwise import _zeros_like_kv
    kv = jax.jit(_zeros_like_kv, static_argnames=("sharding",))
    assert path(kv, sharding=NamedSharding(mesh, PartitionSpec("tp"))) is not None
    other = Mesh(np.array(devs[2:4]).reshape(1, 2), ("fsdp", "tp"))
    assert path(kv, sharding=NamedSharding(other, PartitionSpec("tp"))) is None        # off the inputs' mesh


def _train_update(cache, blockwise: bool, devices=None):
    """One RL update (full or blockwise backward) of a tiny model on an FSDP2 x TP2 mesh (over `devices`, by
    default the first 4; several processes' devices too, each process packing the same samples) through
    `cache`: the params, optimizer state and metrics as host bytes."""
    from jax.experimental.multihost_utils import process_allgather

    from jaxrl.config.loading import from_yaml_file
    from jaxrl.config.train import TrainConfig
    from jaxrl.train import rl
    from jaxrl.train.batch import Sample
    from jaxrl.train.blockwise import BlockwiseUpdater
    from jaxrl.train.optim import init_state, make_optimizer
    from jaxrl.train.step import LossSpec
    from jaxrl.train.update import Updater
    from models import logical_axes
    from sharding import Layout, ShardingRules, shardings_for

    cfg = from_yaml_file(TrainConfig, "configs/quickstart.yaml")
    mcfg = dataclasses.replace(PRESETS["tiny-char"], num_layers=2, hidden_size=64, intermediate_size=128)
    layout = Layout(fsdp=2, tp=2)
    mesh = layout.make_mesh(devices or jax.devices()[:4])
    sh = shardings_for(logical_axes(mcfg), mesh, ShardingRules.train(mcfg, layout))
    spec = LossSpec.from_config(cfg.algo, temperature=1.0, trainer=cfg.trainer)
    tx, _ = make_optimizer(cfg.optim, 10)
    upd = (BlockwiseUpdater(mcfg, spec, tx, block_size=16, cache=cache) if blockwise else
           Updater(mcfg, spec, tx, cache=cache))
    rng = np.random.default_rng(0)
    batch = [Sample(rng.integers(3, 100, rng.integers(3, 12)).tolist(), rng.integers(3, 100, rng.integers(1, 30)).tolist(),
                    float(rng.normal())) for _ in range(6)]
    pack_len = 48
    mbs = rl.micro_batches(batch, cfg, mesh, pack_len, cfg.rollout.max_new_tokens, rl.micro_batch_rows(cfg, mesh, pack_len))
    p = init(jax.random.key(0), mcfg, shardings=sh)
    p, o, m = upd.update(p, init_state(tx, p, sh, mesh), mbs)
    return [np.asarray(process_allgather(x, tiled=True)).tobytes() for x in jax.tree.leaves((p, o, m))]


@pytest.mark.parametrize("blockwise", [False, True], ids=["full", "blockwise"])
def test_the_train_update_from_stored_executables_is_bitwise_the_compiled_one(store, blockwise):
    """The update's executables (the zero sums, the gradient, the optimizer's update, the blockwise backward's
    steps) are keyed by their module-level function, bound configs and the optimizer's config
    (`make_optimizer`); on a sharded train layout, loaded from the store in a fresh cache, they give the
    compiled executables' bits."""
    from jaxrl.rollout.executor import ExecutableCache

    want = _train_update(ExecutableCache(use_store=False), blockwise)
    first = ExecutableCache()
    assert _train_update(first, blockwise) == want
    again = ExecutableCache()
    with Traces(("_grads", "_update", "block_step")) as traces:
        assert _train_update(again, blockwise) == want
    assert first.loads == 0 and first.compiles == again.compiles > 0 and traces.names == []
    # every stored executable loaded, the gradient, update and block steps among them (none traced); a program
    # without inputs that JAX's cache loaded is not stored (no fingerprint: the test above)
    assert again.loads == len(list(store.directory.glob("*.exe"))) >= 2 + blockwise


SCRIPT = textwrap.dedent("""
    import hashlib, os, sys
    import jax, numpy as np
    n = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    jax.config.update("jax_num_cpu_devices", 4)
    if n > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], n, int(os.environ["JAX_PROCESS_ID"]))
    from jaxrl.runtime import enable_compilation_cache
    enable_compilation_cache(sys.argv[1])
    from jaxrl.rollout import SamplingParams, generate
    from jaxrl.rollout.executor import CACHE
    from models import PRESETS, init
    from tests.test_executable_store import Traces, _train_update
    cfg = PRESETS["tiny-qwen3"]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, k).tolist() for k in (3, 9, 16, 5)]
    with Traces(("decode_step", "prefill_step", "_grads", "_update")) as traces:
        outs = generate(cfg, init(jax.random.key(0), cfg), prompts,
                        SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20, seed=3), tp=2, instances=2,
                        page_size=8, num_pages=64, devices=jax.local_devices())
        # the train update on an FSDP2 x TP2 mesh over every process's first 4 / n devices
        mesh = [d for p in range(n) for d in [x for x in jax.devices() if x.process_index == p][:4 // n]]
        train = hashlib.sha256(b"".join(_train_update(CACHE, False, mesh))).hexdigest()
    print("OUT", CACHE.compiles, CACHE.loads, min(d.id for d in jax.local_devices()), len(traces.names), train,
          [o.tokens for o in outs], [np.asarray(o.logprobs).tobytes().hex() for o in outs])
""")


def _python(cache, processes=1):
    cmd = [sys.executable, "-c", SCRIPT, str(cache)]
    if processes > 1:
        cmd = [str(ROOT / "scripts" / "launch_local.sh"), str(processes), *cmd]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [line.split("OUT ", 1)[1].split(" ", 5) for line in p.stdout.splitlines() if "OUT " in line]


@pytest.mark.processes
def test_programs_are_built_once_and_loaded_by_any_process_count(tmp_path):
    """A 2-process job builds each program once: the rollout's on each process's own devices and the train
    update's on a mesh over both processes' devices (one process traces and compiles it, the other waits and
    loads it). With the store emptied, a 1-process job loads the programs from JAX's persistent cache and
    stores them from that cache's bytes (XLA:CPU cannot serialise a loaded executable again); then each
    process of a 2-process job loads every program from the store, the train update's SPMD program the
    1-process job stored too, nothing traced, and gets the bits the first job computed."""
    first = _python(tmp_path / "xla", processes=2)
    assert len(first) == 2 and first[0][4:] == first[1][4:]            # the same tokens, one global update
    stored = len(list((tmp_path / "xla" / "executables").glob("*.exe")))
    assert first[0][0] == first[1][0] and sum(int(c) - int(ld) for c, ld, *_ in first) == stored >= 4   # built once
    shutil.rmtree(tmp_path / "xla" / "executables")
    [one] = _python(tmp_path / "xla")
    assert int(one[1]) > 0 and one[5] == first[0][5]             # (the rollout: the same bits in 1 process)
    again = _python(tmp_path / "xla", processes=2)
    ids = sorted(int(a[2]) for a in again)
    assert len(again) == 2 and ids[0] == 0 < ids[1]          # each on its own devices (process 1's: ids 2048...)
    for a, f in zip(again, first):             # everything loaded (nothing traced), onto other devices, the same bits
        assert a[0] == a[1] == f[0] and a[3] == "0" and a[4:] == f[4:]
