"""Launched as users launch: `mpirun`, `srun` and a Kubernetes Indexed Job with no hand-set variables
(`jaxrl.train.distributed.launch`: JAX's own cluster detection, explicit settings first, one line for a
half-configured environment), the one-line stop when a process dies under `mpirun` (`heartbeat.on_terminate`),
and a resume on another process count and layout (`preflight.LAYOUT_KEYS`, `run_state.moved_meta`).

The runs: one process (fsdp 4, 4 instances) is the reference; `mpirun -np 2` of the same run equals it (the
rollouts exactly, the weights within float32 tolerance: each process packs its own rows, test_train_processes.py);
a second `mpirun -np 2` run loses rank 1 to SIGKILL after its checkpoint 1, and rank 0 stops at once in one line
(mpirun sends it SIGTERM) naming rank 1 and the checkpoint, which then resumes in 1 process on fsdp 2 x tp 2; the
first run's checkpoint 1 resumes in 4 processes started with the variables srun sets (`scripts/launch_local.sh
--srun`); the reference's own checkpoint 1 resumes on 2 instances instead of 4. Each resume equals the reference
from its step on: the rollouts exactly, the weights within float32 tolerance (a resume on another layout continues
on that layout's rounding; the data, the cursor and the tokens do not depend on it), and bit for bit on the
instance change (the same process, mesh and packing). That orbax restores the arrays bit for bit into another mesh is
tests/test_checkpoint.py's test_restore_into_a_different_sharding."""

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl.config.train import DistributedSection
from jaxrl.train import distributed
from jaxrl.train.distributed import K8S, MPIRUN, SRUN, LaunchError, detect, launch
from jaxrl.train.heartbeat import DONE, STOPPING, Heartbeat, terminated_message
from tests.train_runs import (PARAM_ATOL_F32, ROLLOUT_KEYS, ROOT, TINY, _command, _env, _finished, _metrics,
                              _params, _server, _train, log_tail)

NONE = DistributedSection()
OMPI = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node[001-004]", "SLURM_NTASKS": "4", "SLURM_PROCID": "3",
         "SLURM_LOCALID": "0"}
K8S_POD = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
JAX_VARS = {"JAX_COORDINATOR_ADDRESS": "10.0.0.9:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}


def test_each_launcher_is_detected_and_explicit_settings_win():
    assert launch(NONE, {}) == distributed.Launch("single process (no launcher detected)", False)
    for env, name, n in ((OMPI, MPIRUN, 2), (SLURM, SRUN, 4)):
        got = launch(NONE, env)          # JAX's detection fills in all three
        assert (got.source, got.distributed, got.coordinator, got.num_processes, got.process_id, got.processes) \
            == (name, True, None, None, None, n)
    # explicit settings win: all of them (no launcher consulted), or some (JAX detects the rest)
    got = launch(NONE, {**SLURM, **JAX_VARS})
    assert (got.source, got.coordinator, got.num_processes, got.process_id) == \
        ("distributed.* / JAX_* settings", "10.0.0.9:1234", 4, 2)
    got = launch(DistributedSection(coordinator="head:9999"), SLURM)
    assert (got.source, got.coordinator, got.num_processes, got.process_id, got.processes) == \
        (f"distributed.* / JAX_* settings and {SRUN}", "head:9999", None, None, 4)
    assert launch(DistributedSection(num_processes=1), OMPI).distributed is False
    # a Kubernetes Indexed Job configured through the manifest's JAX_* variables needs no API access
    got = launch(NONE, {**K8S_POD, "JOB_COMPLETION_INDEX": "2", **JAX_VARS})
    assert got.distributed and got.process_id == 2
    with pytest.raises(LaunchError, match="4 processes configured .* but srun \\(SLURM\\) started 2"):
        launch(NONE, {**SLURM, "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "JAX_NUM_PROCESSES": "4"})


def test_a_half_configured_launcher_is_one_line_or_one_process():
    # one process in a launcher's environment: the single-process run it describes, and the line says why
    for env, why in (({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, "srun (SLURM job 4242) with one task"),
                     ({"SLURM_JOB_ID": "77", "SLURM_NODELIST": "n1"}, "SLURM job 77 without srun"),
                     ({**OMPI, "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}, MPIRUN),
                     (K8S_POD, "a Kubernetes pod outside an Indexed Job")):
        assert launch(NONE, env) == distributed.Launch(f"single process ({why})", False), env
    errors = {   # variables JAX would take halfway (a KeyError in its plugin, or a wait for processes never started)
        "SLURM job 4242 has SLURM_NTASKS=8 tasks, but this process was not started by srun (SLURM_STEP_NODELIST, "
        "SLURM_PROCID, SLURM_LOCALID unset)": {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "8"},
        "OMPI_MCA_orte_hnp_uri is set (a process of Open MPI's mpirun) but OMPI_COMM_WORLD_SIZE is not":
            {k: v for k, v in OMPI.items() if k != "OMPI_COMM_WORLD_SIZE"},
        "OMPI_COMM_WORLD_SIZE=2 without OMPI_MCA_orte_hnp_uri": {"OMPI_COMM_WORLD_SIZE": "2"},
        "SLURM_PROCID='x': expected an integer >= 0": {**SLURM, "SLURM_PROCID": "x"},
        "SLURM_PROCID=4 not in [0, SLURM_NTASKS=4)": {**SLURM, "SLURM_PROCID": "4"},
        "a Kubernetes Indexed Job (JOB_COMPLETION_INDEX=3), but the kubernetes package": {**K8S_POD,
                                                                                           "JOB_COMPLETION_INDEX": "3"},
        "2 processes configured but no coordinator": {"JAX_NUM_PROCESSES": "2"},
    }
    for message, env in errors.items():
        if "kubernetes package" in message and importlib.util.find_spec("kubernetes"):
            assert detect(env) == (K8S, None)     # (installed here: JAX's detection asks the Job)
            continue
        with pytest.raises(LaunchError) as e:
            launch(NONE, env)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_half_configured_launcher_stops_the_run_in_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    from jaxrl.train.__main__ import main

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    with pytest.raises(SystemExit) as e:
        main([f"run_dir={tmp_path / 'run'}", *TINY])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "not started by srun" in err, err
    assert not (tmp_path / "run").exists()


def test_a_coordinator_that_never_answers_is_one_line_within_the_timeout(tmp_path):
    env = {**_env(), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "1"}          # process 1 of 2; process 0 never starts
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "jaxrl.train", f"run_dir={tmp_path / 'run'}", *TINY,
                        "distributed.initialization_timeout=2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    lines = [x for x in p.stderr.splitlines() if x.startswith("python -m jaxrl.train: error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert ("process 1 (distributed.* / JAX_* settings) could not reach the coordinator 127.0.0.1:" in lines[0]
            and " within distributed.initialization_timeout=2 s" in lines[0]), lines[0]
    assert time.time() - t0 < 60 and not (tmp_path / "run").exists()


@pytest.mark.processes
def test_a_tp_group_across_processes_stops_at_start_up_in_one_line(tmp_path):
    """Each process's batch rows are its own (replicated over tp), so a tp group stays inside one process: 2
    processes of 1 device on tp 2 stop before any step, each with one line."""
    p = subprocess.run([str(ROOT / "scripts" / "launch_local.sh"), "2", sys.executable, "-m", "jaxrl.train",
                        f"run_dir={tmp_path / 'run'}", *TINY, "train_layout.tp=2", "engine.instances=1"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=300)
    lines = [x for x in p.stdout.splitlines() if "a tp group of 2 devices would span processes" in x]
    assert p.returncode != 0 and len(lines) == 2 and "Traceback" not in p.stdout, log_tail(p.stdout)
    assert "(1 device(s) in each of 2); tp must divide a process's devices" in lines[0]


class Store:
    """The coordination service's key-value store as the heartbeat uses it."""

    def __init__(self, kv=None):
        self.kv, self.gone = dict(kv or {}), False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.gone:
            raise RuntimeError("UNAVAILABLE")
        self.kv[key] = value

    def key_value_try_get(self, key):
        if self.gone:
            raise RuntimeError("UNAVAILABLE")
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.kv[key]


def test_sigterm_names_the_processes_that_were_not_stopped_with_this_one(tmp_path):
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    (tmp_path / "checkpoints" / "1" / "COMMITTED").write_text("")
    ckpt = str((tmp_path / "checkpoints" / "1").resolve())
    out = []
    store = Store({"jaxrl/heartbeat/1": "7", "jaxrl/heartbeat/2": STOPPING, "jaxrl/heartbeat/3": DONE})
    hb = Heartbeat(store, 0, 4, timeout_s=20, run_dir=tmp_path, exit_fn=out.append)
    hb.on_terminate(grace_s=0)      # process 1 died (its beat stayed at 7); 2 was stopped too; 3 had finished
    assert out == [75] and store.kv["jaxrl/heartbeat/0"] == STOPPING
    assert terminated_message([1], tmp_path) == ("[train] process 1 stopped, and the launcher stopped this one "
                                                 f"(SIGTERM); stopping this process; the newest checkpoint is {ckpt}: "
                                                 "run the same command again to resume from it")
    assert "every process of the run was stopped" in terminated_message([], tmp_path)
    store.gone = True
    assert "process 0 (the coordinator) stopped" in terminated_message([], tmp_path, store_gone=True)
    Heartbeat(store, 1, 2, timeout_s=20, run_dir=tmp_path, exit_fn=out.append).on_terminate(grace_s=0)
    assert out == [75, 75]


def _rank(mpirun: subprocess.Popen, rank: int, deadline: float) -> int:
    """The pid of `rank` among mpirun's children (its OMPI_COMM_WORLD_RANK)."""
    while time.time() < deadline:
        for d in Path("/proc").iterdir():
            try:
                if not d.name.isdigit() or int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != mpirun.pid:
                    continue
                if f"OMPI_COMM_WORLD_RANK={rank}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    return int(d.name)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under mpirun")


def _by_step(run_dir) -> dict:
    return {r["step"]: r for r in _metrics(run_dir) if "reward_mean" in r}


ARGS = ["optim.eps=1e-3", "warm_start.steps=0", "rewards.fn=tests.dense_reward:score", "steps=3", "save_every=1",
        "train_layout.fsdp=4"]


def _mpirun(run_dir, env=None):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m", "jaxrl.train",
           f"run_dir={run_dir}", *TINY, *ARGS, "engine.instances=2"]
    return subprocess.Popen(cmd, cwd=ROOT, env={**_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun here (.ci/run installs Debian's openmpi-bin)")
def test_mpirun_and_srun_equal_one_process_a_killed_rank_stops_in_one_line_and_resumes_elsewhere(tmp_path):
    one, two, killed, srun, same = (tmp_path / d for d in ("one", "mpirun", "killed", "srun", "instances"))
    # all at once (both cores busy): the reference in this worker's 4-device run server, two mpirun runs, and the
    # srun-style resume once the first mpirun run has its checkpoint 1
    ref_args = _command(one, *ARGS, "engine.instances=4")[3:]
    server = _server(ref_args)
    server.send(ref_args)
    port = _free_port()       # (the second run's coordinator on a port of its own: JAX's override of its choice)
    whole, victim = _mpirun(two), _mpirun(killed, {"JAX_COORDINATOR_PORT": str(port)})
    deadline = time.time() + 600
    rank1 = _rank(victim, 1, deadline)
    while not (killed / "checkpoints" / "1" / "COMMITTED").exists():
        assert victim.poll() is None and time.time() < deadline, "mpirun ended or stalled before checkpoint 1"
        time.sleep(0.05)
    os.kill(rank1, signal.SIGKILL)
    t0 = time.time()
    out = victim.communicate(timeout=120)[0]
    waited = time.time() - t0
    while not (two / "checkpoints" / "1" / "COMMITTED").exists():
        assert whole.poll() is None and time.time() < deadline, "mpirun ended or stalled before checkpoint 1"
        time.sleep(0.05)
    (srun / "checkpoints").mkdir(parents=True)        # (2 processes, fsdp 4) resumed by 4 srun-style processes
    shutil.copy(two / "config.yaml", srun / "config.yaml")
    shutil.copytree(two / "checkpoints" / "1", srun / "checkpoints" / "1")
    moved = subprocess.Popen([str(ROOT / "scripts" / "launch_local.sh"), "--srun", "4", sys.executable, "-m",
                              "jaxrl.train", f"run_dir={srun}", *TINY, *ARGS, "engine.instances=1"], cwd=ROOT,
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # the killed rank: rank 0 stopped at once (mpirun's SIGTERM; the heartbeat would take 20 s), in one line
    assert victim.returncode != 0, log_tail(out)
    lines = [x for x in out.splitlines() if x.startswith("[train] process")]
    newest = max(int(p.name) for p in (killed / "checkpoints").iterdir() if (p / "COMMITTED").exists())
    assert len(lines) == 1 and lines[0].startswith("[train] process 1 stopped, and the launcher stopped this one "
                                                   "(SIGTERM)"), log_tail(out)
    assert f"the newest checkpoint is {(killed / 'checkpoints' / str(newest)).resolve()}:" in lines[0]
    assert waited < 10, waited
    assert f"[train] launch: {MPIRUN}: process 0 of 2, coordinator " in out and f":{port}\n" in out, log_tail(out)
    _finished(server.receive(600))
    # the reference's checkpoint 1 on 2 instances instead of 4: the same process, mesh and packing, so the math
    # does not depend on the change: the uninterrupted run's weights bit for bit
    (same / "checkpoints").mkdir(parents=True)
    shutil.copy(one / "config.yaml", same / "config.yaml")
    shutil.copytree(one / "checkpoints" / "1", same / "checkpoints" / "1")
    assert "at RL step 1 on another layout (engine.instances):" in _train(same, *ARGS, "engine.instances=2").stdout
    for a, b in zip(_params(one), _params(same)):
        np.testing.assert_array_equal(a, b)
    resumed = _train(killed, *ARGS, "train_layout.fsdp=2", "train_layout.tp=2", "engine.instances=4")  # 1 process
    assert (f"resumed from {(killed / 'checkpoints').resolve()} at RL step {newest} on another layout "
            "(train_layout.fsdp, train_layout.tp, engine.instances, 2 -> 1 processes)") in resumed.stdout

    # mpirun -np 2 == 1 process
    log = whole.communicate(timeout=600)[0]
    assert whole.returncode == 0, log_tail(log)
    for rank in (0, 1):
        assert f"[train] launch: {MPIRUN}: process {rank} of 2, coordinator " in log, log_tail(log)
    ref, got = _by_step(one), _by_step(two)
    assert sorted(ref) == sorted(got) == [0, 1, 2]
    for key in ROLLOUT_KEYS:
        assert [got[s][key] for s in ref] == [ref[s][key] for s in ref], key
    for a, b in zip(_params(one), _params(two)):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)

    log = moved.communicate(timeout=600)[0]
    assert moved.returncode == 0, log_tail(log)
    for rank in range(4):
        assert f"[{rank}] [train] launch: {SRUN}: process {rank} of 4, coordinator localhost:" in log, log_tail(log)
    assert "at RL step 1 on another layout (engine.instances, 2 -> 4 processes)" in log, log_tail(log)
    for run, first in ((killed, newest), (srun, 1)):      # each resume == the reference from its step on
        got = _by_step(run)
        assert set(range(first, 3)) <= set(got), sorted(got)
        for key in ROLLOUT_KEYS:
            assert [got[s][key] for s in range(first, 3)] == [ref[s][key] for s in range(first, 3)], (run, key)
        for a, b in zip(_params(one), _params(run)):
            np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)

def _cfg(tmp_path, *args):
    from jaxrl.config import CONFIGS_DIR, load_config
    from jaxrl.config.train import TrainConfig

    return load_config(TrainConfig, [f"run_dir={tmp_path}", *TINY, *args], CONFIGS_DIR / "quickstart.yaml")


def test_a_resume_may_change_the_layout_but_not_what_the_run_computes(tmp_path):
    from jaxrl.config import to_yaml
    from jaxrl.train.preflight import StartupError, plan_resume

    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    (tmp_path / "checkpoints" / "1" / "COMMITTED").write_text("")
    (tmp_path / "config.yaml").write_text(to_yaml(_cfg(tmp_path, "train_layout.fsdp=4", "engine.instances=2")))
    plan = plan_resume(_cfg(tmp_path, "train_layout.fsdp=2", "train_layout.tp=2", "engine.instances=1", "steps=5"))
    assert plan.resume and plan.relayout == ("train_layout.fsdp", "train_layout.tp", "engine.instances")
    assert plan.write_config == "config.step1.yaml"
    assert plan_resume(_cfg(tmp_path, "train_layout.fsdp=4", "engine.instances=2")).relayout == ()
    with pytest.raises(StartupError) as e:       # a key that changes the results still refuses, alone named
        plan_resume(_cfg(tmp_path, "train_layout.fsdp=2", "engine.instances=1", "optim.lr=1e-3"))
    assert "another config: optim.lr (" in str(e.value) and "fsdp" not in str(e.value)
    with pytest.raises(StartupError, match="the checkpoint's 128-token vocabulary is padded to 128 rows .tp 1., "
                                           "this tp pads it to 129"):
        plan_resume(_cfg(tmp_path, "train_layout.fsdp=1", "train_layout.tp=3", "engine.instances=1"))


def test_what_belongs_to_the_old_layout_restarts_or_refuses_in_one_line(tmp_path, capsys):
    from jaxrl.train.preflight import StartupError
    from jaxrl.train.run_state import moved_meta

    cfg = _cfg(tmp_path, "placement=disaggregated", "engine.instances=1", "stage_balance.scale_up=true",
               "stage_balance.max_instances=2", "train_layout.fsdp=2")
    meta = {"step": 4, "instances": 2, "loader": {"epoch": 0, "position": 64, "seed": 0}}
    assert moved_meta(meta, cfg, 2) == {**meta, "instances": 1}       # (this test runs in 1 process)
    assert capsys.readouterr().out == ("[train] stage_balance.scale_up: the checkpoint's pool of 2 generation "
                                       "instances per process belongs to its layout; the scale-up starts again from "
                                       "engine.instances=1\n")
    ahead = {**meta, "ahead": [{"step": 5}]}
    assert moved_meta(ahead, cfg, 1)["ahead"] == ahead["ahead"]        # the same process count: they carry
    with pytest.raises(StartupError, match="holds 1 rollout.s. made ahead by each of its 2 processes .* cannot move "
                                           "to 1 processes; resume it on 2"):
        moved_meta(ahead, cfg, 2)
