"""Shared by the train-run tests: the tiny settings, how a run is started and how its outputs are read.

`_train` runs `python -m jaxrl.train`'s `main()` in this process when the run uses the test worker's 8 fake
devices (the imports and the executables earlier runs in this worker built are reused), else in a run server
with the run's own device count (tests/run_server.py: a long-lived process that does the same for the runs
with that count). A run that must be a real process (killed with SIGKILL, several processes, environment
variables of its own) is started as one: `kill_and_resume`, `_train_together`, `scripts/launch_local.sh`.
"""

import atexit
import contextlib
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxrl.testing import FEWER_SHAPES, TINY  # noqa: F401 (shared with scripts/, which must not import tests/)
from models import load_hf

ROOT = Path(__file__).resolve().parents[1]
PARAM_ATOL_F32 = 1e-5
# a float32 metric that is 0 in exact arithmetic (the KL to a reference equal to the policy, step 0's gradient
# with every advantage 0) but is computed by two programs that may round apart: rounding noise measured 0-6e-9
NOISE_ATOL = 1e-8
# A user's optimisation level (XLA's passes, LLVM level 1: `jaxrl.runtime.cpu_compile_level`), with the suite's
# LLVM fusion emitters: the suite's own settings (tests/conftest.py), pinned for the runs checked against goldens
# recorded at it (their rollouts depend on float rounding) even when the suite runs at level 0
# (JAX_DISABLE_MOST_OPTIMIZATIONS=1). The older emitters compile in less time than XLA's default ones (the four
# test_train_e2e.py runs at this level, empty cache: 217 -> 190 CPU-s); the rewards and rollouts stay exact and the
# losses within their tolerances. GOLDEN_OPT: XLA's defaults exactly (LLVM level 3, XLA's default emitters), for
# a golden that records the weights' bits (tests/golden/flow_default.json's params_sha256).
DEFAULT_OPT = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "0",
               "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"}
GOLDEN_OPT = {**DEFAULT_OPT, "XLA_FLAGS": "--xla_backend_optimization_level=3"}


def _env():
    env = dict(os.environ)          # (XLA_FLAGS included: the suite's compile settings, tests/conftest.py)
    env["JAX_PLATFORMS"] = "cpu"
    return env


@dataclasses.dataclass
class Finished:
    """A finished run's output (what it printed; its progress bars and log lines included)."""
    stdout: str
    stderr: str


def _devices(args) -> int | None:
    """The devices a run of `args` (TINY included) uses in its process; None for a run with `--` flags other
    than `--config FILE`."""
    from jaxrl.config import CONFIGS_DIR, load_config
    from jaxrl.config.train import TrainConfig
    from jaxrl.train.__main__ import _flags, local_devices

    argv, _ = _flags(list(args))
    if any(a.startswith("--") and a != "--config" and not a.startswith("--config=") for a in argv):
        return None                         # (--config FILE: load_config reads it, as main() does)
    return local_devices(load_config(TrainConfig, argv, CONFIGS_DIR / "quickstart.yaml"))


def _in_this_process(args) -> bool:
    """Whether a run of `args` (TINY included) uses exactly this process's devices. A run that needs fewer
    runs in a process with that many (`_server`): XLA:CPU rounds some reductions differently with another
    device count in the process (measured: the default 1-device run's step-0 gradient norm 1.23e-9 in a 1- or
    2-device process, 2.26e-9 in an 8-device one), and the goldens and kill/resume twins compare bits."""
    return _devices(args) == jax.local_device_count()


def _command(run_dir, *extra) -> list[str]:
    return [sys.executable, "-m", "jaxrl.train", f"run_dir={run_dir}", *TINY, *extra]


def _train(run_dir, *extra, timeout=600, env=None):
    """`python -m jaxrl.train run_dir=RUN_DIR TINY... EXTRA...` to completion: in this process when the run
    uses all its devices (`_in_this_process`) and `env` adds no environment variables, else in a fresh one."""
    args = _command(run_dir, *extra)[3:]
    if env is not None or not _in_this_process(args):
        return _train_subprocess(run_dir, *extra, timeout=timeout, env=env)
    return _train_here(args)


def _train_here(args) -> Finished:
    """`main(args)` in this process, its programs compiled at the level of the runs the tests start (a user's,
    unless JAX_DISABLE_MOST_OPTIMIZATIONS=1), not at this process's own level 0 (tests/conftest.py)."""
    from jaxrl.train.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    level0 = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    except SystemExit as e:
        code = e.code
    finally:
        jax.config.update("jax_disable_most_optimizations", level0)
    assert code == 0, out.getvalue()[-3000:] + err.getvalue()[-3000:]
    return Finished(out.getvalue(), err.getvalue())


# Long-lived run processes (tests/run_server.py), by (device count, environment variables changed): at most
# MAX_SERVERS alive per test worker, the least recently used closed first (each holds its executables).
SERVED_ENV = set(GOLDEN_OPT)      # the only variables a served run may change
MAX_SERVERS = 2
_SERVERS: dict = {}


def served_cpu_s() -> float:
    """CPU seconds the live run servers have used (tests/conftest.py adds them to each test's CPU time)."""
    return sum(server.cpu_s() for server in _SERVERS.values())


@atexit.register
def _close_servers():
    while _SERVERS:
        _SERVERS.popitem()[1].close()


def _server(args, env=None):
    """The run server for a run of `args` with `env` (its device count, the variables it changes), started
    if need be; None where the run must be a fresh process (`--` flags, other environment variables)."""
    from tests.run_server import RunServer

    base = _env()
    changed = {k: v for k, v in (env or {}).items() if base.get(k) != v}
    devices = _devices(args)
    if devices is None or not set(changed) <= SERVED_ENV:
        return None
    key = (devices, tuple(sorted(changed.items())))
    server = _SERVERS.pop(key, None)
    if server is None or not server.alive():
        if server is not None:
            server.close()                  # (a server that died: reaped, its CPU counted)
        idle = [k for k, s in _SERVERS.items() if not s.pending]        # (least recently used first)
        for k in idle[:max(0, len(_SERVERS) + 1 - MAX_SERVERS)]:
            _SERVERS.pop(k).close()
        server = RunServer(devices, {**base, **changed})
    _SERVERS[key] = server                  # (most recently used last)
    return server


def _finished(reply) -> Finished:
    code, out, err = reply
    assert code == 0, out[-3000:] + err[-3000:]
    return Finished(out, err)


def _train_subprocess(run_dir, *extra, timeout=600, env=None):
    return run_main(_command(run_dir, *extra)[3:], timeout=timeout, env=env)


def run_main(args, timeout=600, env=None):
    """`python -m jaxrl.train ARGS` (TINY not added) to completion, outside this process: in the run server
    for its device count and `env` where it can be served, else as a fresh process."""
    server = _server(args, env)
    if server is not None:
        return _finished(server.run(args, timeout))
    p = subprocess.run([sys.executable, "-m", "jaxrl.train", *args], cwd=ROOT, env={**_env(), **(env or {})},
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _train_together(*runs, timeout=600):
    """`_train` for each (run_dir, *extra): the runs for other device counts handed to their run servers
    first, which run them while the runs that fit this process run here, one after the other."""
    args = [_command(*run)[3:] for run in runs]
    here = [a for a in args if _in_this_process(a)]
    served = [(_server(a), a) for a in args if a not in here]
    for server, a in served:
        server.send(a)
    for a in here:
        _train_here(a)
    for server, a in served:
        _finished(server.receive(timeout))


def _params(run_dir):
    return [np.asarray(x) for x in jax.tree.leaves(load_hf(Path(run_dir) / "hf")[1])]


def _checkpoint_tree(run_dir):
    """A run's newest checkpoint state as saved (nested dicts of numpy arrays)."""
    import orbax.checkpoint as ocp

    step = max(int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir() if p.name.isdigit())
    path = Path(run_dir) / "checkpoints" / str(step) / "state"
    ckpt = ocp.PyTreeCheckpointer()
    tree = ckpt.metadata(path)
    tree = getattr(tree, "item_metadata", tree)
    tree = getattr(tree, "tree", tree)
    return ckpt.restore(path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))


def _checkpoint_leaves(run_dir, key):
    """The arrays of `key` (e.g. "critic": its params and AdamW state) in a run's newest checkpoint."""
    return jax.tree.leaves(_checkpoint_tree(run_dir)[key])


def _same_weights(ref, *runs):
    """Each run's final weights equal `ref`'s within PARAM_ATOL_F32."""
    want = _params(ref)
    for run in runs:
        for a, b in zip(want, _params(run)):
            np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# Tail batching (RollPacker) with eta_prompts 1.5: 12 prompts drawn, 8 trained, 4 queued per short round, so
# steps 0, 1 are short rounds, step 2 a long one (the 8 queued prompts), step 3 short again.
TAIL = ["rollout.tail_batching.enabled=true", "rollout.tail_batching.eta_prompts=1.5"]
TAIL_KINDS = [0, 0, 1, 0]


# StreamRL: 4 generation devices beside a 4-device train mesh; 2-row micro-batches so groups stream during the
# rollout. The colocated twin runs the same instances and train layout on 4 shared devices.
POOLS = ["engine.instances=4", "train_layout.fsdp=4", "trainer.micro_batch_tokens=256", "optim.eps=1e-3",
         "warm_start.optim.eps=1e-3"]
ROLLOUT_KEYS = ["reward_mean", "response_len_mean", "response_len_max", "pass_rate"]

# StreamRL skew-aware placement over 4 instances, the length ranker refreshed every step (tiny sizes).
SKEW = ["rollout.skew.enabled=true", "engine.instances=4", "train_layout.fsdp=4", "rollout.skew.ranker.train_steps=20",
        "rollout.skew.ranker.refresh_every=1",
        "rollout.skew.ranker.d_model=32", "rollout.skew.ranker.batch=16"]


def kill_and_resume(full, killed, args, env=None):
    """`args` run uninterrupted in `full` and, alongside (both cores compile), in `killed`, a process of its own,
    which is killed (SIGKILL) once checkpoint 2 exists and then resumed by the same command: the final weights
    must be bit-identical. `env`: environment variables added for all three. The uninterrupted run and then the
    resume run in the run server for the run's device count (`run_main`: the same device count and flags as a
    process of its own), so the resume finds every program traced and loaded by the uninterrupted run instead
    of starting a server that imports, traces and loads them again (test_train_resume.py, empty cache, alone:
    141 -> 108 CPU-s)."""
    env = {**_env(), **(env or {})}
    whole = _server(_command(full, *args)[3:], env)
    if whole is not None:
        whole.send(_command(full, *args)[3:])
    else:
        whole = subprocess.Popen(_command(full, *args), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    p = subprocess.Popen(_command(killed, *args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "2").exists():
        assert p.poll() is None and time.time() < deadline, "run ended or stalled before step 2 was saved"
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    if isinstance(whole, subprocess.Popen):
        log = whole.communicate(timeout=600)[0]
        assert whole.returncode == 0, log[-3000:]
    else:
        _finished(whole.receive(600))
    assert not (killed / "hf").exists()
    out = _train_subprocess(killed, *args, env=env)     # (as the twin ran: same device count)
    assert "resumed" in out.stdout + out.stderr
    for a, b in zip(_params(full), _params(killed)):
        np.testing.assert_array_equal(a, b)


DYNAMIC = ["rollout.tail_batching.dynamic_sampling=true", "rollout.tail_batching.max_waves=2"]
# Skew placement live from step 0: the length ranker warm-started from the committed quickstart's pairs.
WARM_SKEW = ["rollout.skew.enabled=true", "rollout.skew.ranker.train_steps=20", "rollout.skew.ranker.d_model=32",
             "rollout.skew.ranker.batch=16",
             f"rollout.skew.ranker.pairs={ROOT / 'scripts' / 'results' / 'quickstart_length_pairs.jsonl'}"]


# 1 process vs N: (extra settings, N). Dynamic sampling runs on tail batching's rounds (steps 0, 1 short, step 2
# the long round), so it covers both mechanisms' global agreement.
# PPO (the `ppo` graph): a critic, GAE, the KL to the reference in the token rewards (node reward_kl), and a
# dense reward (the tiny policy's 0/1 rewards would be ~all 0: advantages of float noise). Step 0 has no KL
# yet (policy == reference) and the critic's first values are 0, so step 2 is the first where all of it is
# live. Its 1-process run saves every step: test_ppo_resume_restores_the_critic resumes from checkpoint 2.
PPO = ["algo.advantage=gae", "algo.kl_coef=0.05", "algo.kl_in_reward=true", "steps=3",
       "rewards.fn=tests.dense_reward:score"]
# RollPacker's stream trainer with a reference (its copy on the freed devices is the collective kind)
STREAM = ["trainer.stream.enabled=true", "trainer.micro_batch_tokens=256", "algo.kl_coef=0.05"]
# GRPO: 4 processes on tail batching's rounds with DAPO dynamic sampling (the plain synchronous chain is the
# same chain of nodes), repartitioned by tokens; PPO on 2 processes, also repartitioned. Each shares its
# 1-process run. (Local packing without the repartition across processes: test_disaggregated_processes_equal_one.)
# The stream trainer: 2 processes and 4 (each frees its own instances, streams its own groups); with MetroRLHF's
# blockwise backward on the rollout's K/V (each process's streamed blocks planned on its own).
# Multi-turn at the tiny size: Echo answers every 3-token turn until max_turns (3) (a random policy would call no
# tool, so the tools environment would end each trajectory at its first turn).
ECHO_TURNS = ["rollout.env=jaxrl.envs._testing:Echo", "rollout.turns.turn_max_tokens=3", "rollout.max_new_tokens=32"]
# PAT on 2 processes (each pool tp1x2 -> tp2x1 at the first check, one decision agreed by both; the 1-process pool
# tp1x4 -> tp2x2) with MetroRLHF's blockwise backward on the rollout's K/V (each process stages its own
# sequences' K/V, migrated by the switch), on the forcing profile (tests/pat_profiles.py; no device count, so
# one file serves both pool sizes) and a dense reward (the tiny policy's 0/1 rewards are ~all 0).
PAT_PROFILE = ROOT / "tests" / "golden" / "pat_forcing_large.json"
PAT_KV = ["engine.tp=1", "engine.adaptive_tp.enabled=true", f"engine.adaptive_tp.profile={PAT_PROFILE}",
          "engine.adaptive_tp.candidates=[1, 2]", "engine.adaptive_tp.check_every=4", "engine.adaptive_tp.kv=migrate",
          "rewards.fn=tests.dense_reward:score", "trainer.backward=blockwise", "trainer.block_size=48",
          "trainer.kv_source=rollout"]
# (extra settings, N processes, devices in all: an fsdp mesh over all of them and one TP1 instance per device).
# 4 devices where each process needs at most 2 (a 4-device run costs ~2/3 of an 8-device one's CPU: each fake
# device is a thread that every collective waits for); 8 where each of 4 processes needs 2 (the stream trainer
# frees half of its process's instances). PAT runs on 2 processes, not 4 (80 CPU-s with its 1-process twin on 8
# devices): the agreement is the same exchange over processes, which four_balanced and stream_four run on 4.
# The stream trainer on 2 processes with the full backward is not a mode of its own: stream_four makes its
# assertions on 4 processes, stream_kv_two on 2 (each N-process run with its 1-process twin costs ~50 CPU-s).
MODES = {"four_balanced": (TAIL + ["steps=3"] + DYNAMIC + ["trainer.repartition=tokens",
                                                          "eval.split=10", "eval.every=2", "eval.samples=2"], 4, 4),
         "ppo_two_balanced": (PPO + ["trainer.repartition=tokens"], 2, 4),
         "stream_four": (STREAM, 4, 8),
         "stream_kv_two": (STREAM + ["trainer.backward=blockwise", "trainer.block_size=48",
                                     "trainer.kv_source=rollout"], 2, 4),
         "multiturn_two": (ECHO_TURNS + ["trainer.repartition=tokens", "eval.split=6"], 2, 4),
         "pat_kv_two": (PAT_KV, 2, 4)}
COMMON = ["steps=2", "save_every=null", "optim.eps=1e-3", "warm_start.optim.eps=1e-3", "critic.optim.eps=1e-3"]
PPO_DEVICES = MODES["ppo_two_balanced"][2]
_ONE_PROCESS_RUNS = {}


def layout(devices: int, procs: int = 1) -> list[str]:
    """An fsdp mesh over `devices` and one TP1 instance per device, for each of `procs` processes."""
    return [f"train_layout.fsdp={devices}", f"engine.instances={devices // procs}"]


def _one_process(tmp_path_factory, extra, devices):
    """The 1-process run of `COMMON + extra` on `devices` (`layout`; without the repartition, which has nothing
    to move in one process), run once per session and shared by the tests that compare against it."""
    key = tuple(COMMON + [x for x in extra if x != "trainer.repartition=tokens"] + layout(devices))
    if key not in _ONE_PROCESS_RUNS:
        _ONE_PROCESS_RUNS[key] = tmp_path_factory.mktemp("one")
        # every step saved only for PPO's run (test_ppo_resume_restores_the_critic resumes from its checkpoint 2);
        # the others keep COMMON's final checkpoint alone (each save: orbax's threads, a few tenths of a CPU-s)
        saves = ["save_every=1"] if set(PPO) <= set(extra) else []
        _train(_ONE_PROCESS_RUNS[key], *key, *saves)
    return _ONE_PROCESS_RUNS[key]


def log_tail(log: str, chars: int = 6000) -> str:
    """The end of a failed multi-process run's log without the coordination service's abort noise (status
    payloads and C++ stack frames, thousands of characters per process), so the lines that say what went
    wrong, a stuck process's thread stacks (heartbeat.ExitWatch) among them, fit in the assertion message."""
    keep = [line for line in log.splitlines() if "googleapis.com" not in line and "    @     0x" not in line]
    return "\n".join(keep)[-chars:]

