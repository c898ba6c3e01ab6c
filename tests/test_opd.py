"""On-policy distillation (algo.advantage=opd): the advantage against a hand computation, the teacher's
log-probs against its own forward on another layout, a teacher equal to the student (every distillation
term 0, the update the reward-only one), 2 processes == 1 with a teacher of another architecture, kill -9 +
resume with LoRA (the teacher the student's base) on multi-turn trajectories, and the start-up refusals."""

import dataclasses
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxrl import algos
from jaxrl.flow import opd
from jaxrl.train.teacher import ROWS, Teacher
from models import PRESETS, CharTokenizer, forward, init, logical_axes, save_hf
from sharding import Layout, ShardingRules, shardings_for
from tests.train_runs import (COMMON, ECHO_TURNS, PARAM_ATOL_F32, ROOT, TINY, _checkpoint_leaves, _env, _metrics,
                              _one_process, _params, _train, kill_and_resume, layout)

LOGP_ATOL_F32 = 1e-5      # one float32 forward against another on other shardings (sums in another order)
TEACHER_CFG = dataclasses.replace(PRESETS["tiny-char"], num_layers=2, intermediate_size=192)   # another architecture


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """An HF checkpoint of another architecture than the student's (tiny-char, 4 layers) with its tokenizer."""
    d = tmp_path_factory.mktemp("teacher") / "hf"
    save_hf(d, TEACHER_CFG, init(jax.random.key(7), TEACHER_CFG, jnp.float32), tokenizer=CharTokenizer())
    return d


def test_advantage_equals_a_hand_computation():
    t = np.array([[-1.0, -2.0, -30.0, 0.0], [-0.5, -0.5, 0.0, 0.0]], np.float32)
    s = np.array([[-1.5, -1.0, -1.0, -9.0], [-0.5, -4.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    rewards = np.array([[1.0, 0.0]], np.float32)              # one prompt, 2 samples
    got = np.asarray(algos.compute_advantages("opd", teacher_logp=t, student_logp=s, mask=mask, rewards=rewards,
                                              reward_weight=0.5, kl_clip=10.0))
    # lp_T - lp_S, clipped to +-10, plus 0.5 x GRPO's (r - mean) / (std + 1e-6): r - mean = +-0.5, and the
    # sample std sqrt((0.25 + 0.25) / (2 - 1))
    group = 0.5 * np.array([0.5, -0.5]) / (np.sqrt(0.5) + 1e-6)
    want = np.array([[0.5 + group[0], -1.0 + group[0], -10.0 + group[0], 0.0],
                     [0.0 + group[1], 3.5 + group[1], 0.0, 0.0]])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    plain = np.asarray(algos.compute_advantages("opd", teacher_logp=t, student_logp=s, mask=mask))
    np.testing.assert_array_equal(plain, np.array([[0.5, -1.0, -29.0, 0], [0.0, 3.5, 0, 0]], np.float32))
    m = opd.metrics(np.array([0.5, -1.0, 2.0]), np.array([-1.0, -2.0, -3.0]), np.array([1.0, 1.0, 2.0]),
                    np.array([0.0, 2.0, 2.0]))
    assert m == {"opd/reverse_kl": pytest.approx(0.5), "opd/reverse_kl_p90": pytest.approx(1.7),
                 "opd/teacher_logp": pytest.approx(-2.0), "opd/reward_share": pytest.approx(0.5)}


def test_teacher_logprobs_equal_its_own_forward_on_its_own_layout(teacher_dir):
    """The teacher's program: rows packed on a 4-device fsdp train mesh, its weights on its own fsdp2 x tp2
    mesh over the same devices; the log-probs of the targets equal a plain log-softmax of its forward."""
    from models import load_hf

    cfg, weights = load_hf(teacher_dir)
    devices = jax.devices()[:4]
    train_mesh, mesh = Layout(fsdp=4).make_mesh(devices), Layout(fsdp=2, tp=2).make_mesh(devices)
    sh = shardings_for(logical_axes(cfg), mesh, ShardingRules.train(cfg, Layout(fsdp=2, tp=2)))
    params = jax.device_put(weights, sh)
    spec = SimpleNamespace(temperature=1.0, attention_impl="xla")      # (what the teacher reads of the loss spec)
    teacher = Teacher(SimpleNamespace(spec=spec, mesh=train_mesh), params, cfg, mesh)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 100, (4, 24)).astype(np.int32)
    seg = np.repeat(np.array([[1] * 10 + [2] * 14]), 4, 0).astype(np.int32)      # two sequences per row
    pos = np.concatenate([np.arange(10), np.arange(14)])[None].repeat(4, 0).astype(np.int32)
    targets = np.roll(tokens, -1, 1)
    mb = {"tokens": tokens, "positions": pos, "segment_ids": seg, "targets": targets,
          "loss_mask": np.ones_like(tokens), "advantages": np.zeros((4, 24), np.float32),
          "weights": np.zeros((4, 24), np.float32)}
    rows = NamedSharding(train_mesh, ROWS)
    got = teacher.logprobs({k: jax.device_put(v, rows) for k, v in mb.items()}, policy=None)
    assert got.sharding.is_equivalent_to(rows, 2)
    logits = forward(weights, cfg, jnp.asarray(tokens), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
    want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1)), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got), want, atol=LOGP_ATOL_F32, rtol=0)


def test_a_teacher_equal_to_the_student_gives_zero_and_the_reward_only_update(tmp_path):
    """teacher.hf_path null (the reference: the weights RL starts from) and the trainer's student log-probs: while
    the student is still its teacher every distillation term is exactly 0 (one program, the same weights), so
    with reward_weight=1 each update is GRPO's, bit for bit. Here step 0 trains nothing (no reward yet) and step 1
    does; after it (step 2) the student has moved away from its teacher."""
    opd_run, grpo_run = tmp_path / "opd", tmp_path / "grpo"
    _train(opd_run, *COMMON, "steps=3", "save_every=1", "algo.advantage=opd", "algo.opd.student_logp=trainer",
           "algo.opd.reward_weight=1.0")
    _train(grpo_run, *COMMON, "steps=3", "save_every=1")         # (the same steps: the same lr schedule)
    m, g = _metrics(opd_run), _metrics(grpo_run)
    assert [r["opd/reverse_kl"] for r in m[:2]] == [r["opd/reverse_kl_p90"] for r in m[:2]] == [0.0, 0.0]
    assert g[1]["grad_norm"] > 0 and m[1]["opd/reward_share"] == 1.0      # (an update: the test is not vacuous)
    assert m[2]["opd/reverse_kl"] != 0.0
    for k in ("reward_mean", "loss", "grad_norm"):
        assert [r[k] for r in m[:2]] == [r[k] for r in g[:2]], k
    opd_two, grpo_two = tmp_path / "opd2", tmp_path / "grpo2"        # (each run's checkpoint after 2 updates, alone)
    for src, dst in ((opd_run, opd_two), (grpo_run, grpo_two)):
        shutil.copytree(src / "checkpoints" / "2", dst / "checkpoints" / "2")
    for x, y in zip(_checkpoint_leaves(opd_two, "params"), _checkpoint_leaves(grpo_two, "params")):
        np.testing.assert_array_equal(x, y)


@pytest.mark.processes
def test_two_processes_on_a_teacher_pool_equal_one_colocated(tmp_path, tmp_path_factory, teacher_dir):
    """A teacher of another architecture (2 layers): 1 process, the teacher on its own fsdp2 x tp2 layout over the
    4 train devices, == 2 processes x (2 train devices + 1 of the teacher's pool: teacher.placement=pool), each
    process's rows scored on its own pool device; the same rollouts, opd/ metrics and weights (COMMON's
    eps=1e-3: tests/test_train_processes.py)."""
    extra = ["algo.advantage=opd", f"teacher.hf_path={teacher_dir}", "algo.opd.reward_weight=0.5",
             "trainer.micro_batch_tokens=512"]
    one = _one_process(tmp_path_factory, extra + ["teacher.layout.fsdp=2", "teacher.layout.tp=2"], 4)
    many = tmp_path / "many"
    cmd = [str(ROOT / "scripts" / "launch_local.sh"), "2", sys.executable, "-m", "jaxrl.train", f"run_dir={many}",
           *TINY, *COMMON, *extra, "teacher.placement=pool", "teacher.devices=1", *layout(4, 2)]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "(2 layers) on its own pool of 2 devices, layout" in p.stdout + p.stderr
    m1, m2 = _metrics(one), _metrics(many)
    assert all(r["opd/reverse_kl"] > 0 for r in m1)             # (a teacher other than the student)
    for k in ("reward_mean", "response_len_mean", "flow/samples"):
        assert [r[k] for r in m1] == [r[k] for r in m2], k
    for k in ("opd/reverse_kl", "opd/reverse_kl_p90", "opd/teacher_logp", "opd/reward_share"):
        assert [r[k] for r in m2] == pytest.approx([r[k] for r in m1], rel=1e-5, abs=1e-7), k
    for a, b in zip(_params(one), _params(many)):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)


def test_lora_multi_turn_kill_and_resume_is_bit_identical(tmp_path):
    """LoRA adapters distilled towards their own base (teacher.hf_path null) on 3-turn trajectories (the
    observations are context: masked out of the advantage): killed after checkpoint 2, resumed, bit-identical."""
    args = ["steps=4", "save_every=1", "algo.advantage=opd", "model.lora.rank=4", "model.lora.alpha=8",
            "optim.lr=0.01", "algo.opd.reward_weight=0.5", *ECHO_TURNS]
    kill_and_resume(tmp_path / "full", tmp_path / "killed", args)
    m = _metrics(tmp_path / "full")
    assert m[0]["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-4)      # the engine's log-probs vs the trainer's
    assert abs(m[-1]["opd/reverse_kl"]) > 1e-4 and all(r["env/turns_max"] == 3 for r in m)


def test_refusals_at_start_up(tmp_path, teacher_dir):
    """A teacher without a tokenizer, or with another vocabulary, stops the run in one line before any step."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((teacher_dir / name).read_bytes())
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "model.safetensors"):
        (other / name).write_bytes((teacher_dir / name).read_bytes())
    tok = json.loads((teacher_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    letters = [c for c in "abcdefghijklmnopqrstuvwxyz"]
    ids = [vocab[c] for c in letters]
    vocab.update(zip(letters, reversed(ids)))        # the letters' ids reversed: another vocabulary
    (other / "tokenizer.json").write_text(json.dumps(tok))
    (other / "tokenizer_config.json").write_bytes((teacher_dir / "tokenizer_config.json").read_bytes())
    for d, words in ((bare, "has no tokenizer.json"), (other, "its tokenizer differs from the student's")):
        p = subprocess.run([sys.executable, "-m", "jaxrl.train", f"run_dir={tmp_path / 'run'}", *TINY, "steps=1",
                            "algo.advantage=opd", f"teacher.hf_path={d}"], cwd=ROOT, env=_env(), capture_output=True,
                           text=True, timeout=300)
        assert p.returncode != 0 and words in p.stderr + p.stdout, p.stderr[-2000:]
        assert "rl:" not in p.stderr and "warm start" not in p.stderr


def test_a_student_warm_starts_on_a_column_of_teacher_samples(tmp_path):
    """warm_start.response_key: the supervised warm start takes each row's demonstration from that column (a
    teacher's sampled responses, for the student of a distillation run) instead of skipping non-built-in data;
    a row without it stops the run in one line."""
    from jaxrl.config import CONFIGS_DIR, load_config
    from jaxrl.config.train import TrainConfig
    from jaxrl.train.warm_start import demonstrations

    rows = [{"prompt": f"What is {a} + {a}?", "answer": str(2 * a), "teacher": f"{a} + {a} = {2 * a}"}
            for a in range(40)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(TrainConfig, ["warm_start.response_key=teacher", f"data.source={data}"],
                      CONFIGS_DIR / "quickstart.yaml")
    tok = CharTokenizer()
    got = demonstrations(rows[:2], tok, cfg)
    assert [s.response for s in got] == [tok.encode("0 + 0 = 0") + [2], tok.encode("1 + 1 = 2") + [2]]
    out = _train(tmp_path / "run", "steps=1", f"data.source={data}", "warm_start.response_key=teacher")
    assert "warm start skipped" not in out.stdout + out.stderr and "warm start: 100%" in out.stderr
    data.write_text(data.read_text() + json.dumps({"prompt": "What is 1 + 2?", "answer": "3"}) + "\n")
    p = subprocess.run([sys.executable, "-m", "jaxrl.train", f"run_dir={tmp_path / 'bad'}", *TINY, "steps=1",
                        f"data.source={data}", "warm_start.response_key=teacher"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "has no string 'teacher' column" in p.stderr + p.stdout, p.stderr[-2000:]


def test_shrink_keeps_the_first_layers_and_the_tokenizer(tmp_path, teacher_dir):
    """`python -m models.shrink SRC DST --layers N` (a student from its teacher): the first N layers, the same
    embedding and head, the tokenizer files; a layer count out of range is one line."""
    from models import load_hf

    p = subprocess.run([sys.executable, "-m", "models.shrink", str(teacher_dir), str(tmp_path / "s"), "--layers", "1"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (cfg, small), (_, big) = load_hf(tmp_path / "s"), load_hf(teacher_dir)
    assert cfg.num_layers == 1 and cfg == dataclasses.replace(TEACHER_CFG, num_layers=1)
    for a, b in zip(jax.tree.leaves(small.layers), jax.tree.leaves(big.layers)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:1])
    np.testing.assert_array_equal(np.asarray(small.embed), np.asarray(big.embed))
    assert (tmp_path / "s" / "tokenizer.json").read_text() == (teacher_dir / "tokenizer.json").read_text()
    p = subprocess.run([sys.executable, "-m", "models.shrink", str(teacher_dir), str(tmp_path / "t"), "--layers", "5"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "has 2 decoder layers" in p.stderr



@pytest.mark.parametrize("args, key", [
    (["teacher.hf_path=x"], "teacher"),                                          # a teacher without opd
    (["algo.advantage=opd", "trainer.micro_batch_tokens=null"], "trainer.micro_batch_tokens"),
    (["algo.advantage=opd", "trainer.stream.enabled=true"], "trainer.stream.enabled"),
    (["algo.advantage=opd", "algo.opd.student_logp=trainer", "placement=disaggregated", "trainer.max_staleness=1"],
     "algo.opd.student_logp"),
    (["algo.advantage=opd", "teacher.placement=pool", "teacher.devices=1"], "teacher.placement"),   # reference
    (["algo.advantage=opd", "teacher.hf_path=x", "teacher.placement=pool", "teacher.devices=1",
      "placement=disaggregated"], "teacher.placement"),
    (["algo.advantage=opd", "teacher.devices=2"], "teacher.devices"),
    (["algo.advantage=opd", "teacher.layout.fsdp=2"], "teacher.layout"),          # 2 devices for a 1-device layout
    (["algo.advantage=opd", "algo.opd.kl_clip=0"], "algo.opd.kl_clip"),
])
def test_config_refusals_name_the_key(args, key):
    from jaxrl.config import CONFIGS_DIR, ConfigError, load_config
    from jaxrl.config.train import TrainConfig

    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, args, CONFIGS_DIR / "quickstart.yaml")
    assert e.value.key == key, e.value
