"""Typed configs: YAML round trip, dotted overrides, errors that name the key, every configs/*.yaml loads."""

import dataclasses
import json
import re
import shlex

import pytest
import yaml

from jaxrl.config import (CONFIG_CLASSES, CONFIGS_DIR, DTYPES, ConfigError, DemoConfig, LayoutSection, MeshSection,
                          ModelSection, Section, from_yaml, from_yaml_file, load_config, parse_cli, to_yaml)
from models import config_from_hf
from models.config import PRESETS, ModelConfig
from sharding import Layout

DEMO_YAML = CONFIGS_DIR / "demo.yaml"

# configs/demo.yaml is the 8-device recipe; DemoConfig's own defaults use one device. This is the
# documented difference between the two.
DEMO_RECIPE = dataclasses.replace(
    DemoConfig(), mesh=MeshSection(train=LayoutSection(dp=1, fsdp=4, tp=2), rollout_tp=2, rollout_instances=4))


def config_error(fn, *args) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    return info.value


# -- serialisation -----------------------------------------------------------------------------------

def _lists(x):
    if isinstance(x, dict):
        return {k: _lists(v) for k, v in x.items()}
    return [_lists(v) for v in x] if isinstance(x, (list, tuple)) else x


@pytest.mark.parametrize("cfg", [
    DemoConfig(),
    DEMO_RECIPE,
    DemoConfig(model=ModelSection(preset="qwen3-8b", hf_path="/ckpt/Qwen3-8B", dtype="bfloat16"),
               mesh=MeshSection(train=LayoutSection(dp=2, fsdp=2, tp=2), rollout_tp=8), seed=7, run_dir="010"),
])
def test_yaml_round_trip(cfg):
    text = to_yaml(cfg)
    assert from_yaml(DemoConfig, text) == cfg
    # Plain nested YAML in field order: no values encoded as strings, nothing the dataclass lacks (a tuple
    # field, e.g. model.lora.targets, is a YAML sequence: a list once loaded).
    assert yaml.safe_load(text) == _lists(dataclasses.asdict(cfg))
    assert list(yaml.safe_load(text)) == [f.name for f in dataclasses.fields(DemoConfig)]


def test_configs_are_frozen_section_dataclasses():
    seen, todo = set(), list(CONFIG_CLASSES.values())
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        assert dataclasses.is_dataclass(cls) and issubclass(cls, Section), cls
        assert cls.__dataclass_params__.frozen, cls
        todo += [type(getattr(cls(), f.name)) for f in dataclasses.fields(cls)
                 if dataclasses.is_dataclass(type(getattr(cls(), f.name)))]
    assert {ModelSection, LayoutSection, MeshSection, DemoConfig} <= seen
    with pytest.raises(dataclasses.FrozenInstanceError):
        DemoConfig().seed = 1


# -- configs/ ----------------------------------------------------------------------------------------

def test_demo_yaml_is_the_documented_recipe():
    assert from_yaml_file(DemoConfig, DEMO_YAML) == DEMO_RECIPE
    assert load_config(DemoConfig, [], default_yaml=DEMO_YAML) == DEMO_RECIPE
    assert DEMO_RECIPE.mesh.train.num_devices == DEMO_RECIPE.mesh.rollout_devices == 8


def test_every_yaml_in_configs_has_a_class_and_parses():
    files = sorted(p.name for p in CONFIGS_DIR.glob("*.y*ml"))
    assert files == sorted(CONFIG_CLASSES), "register each configs/*.yaml in jaxrl.config.CONFIG_CLASSES"
    for name, cls in CONFIG_CLASSES.items():
        assert isinstance(from_yaml_file(cls, CONFIGS_DIR / name), cls)


# -- command line ------------------------------------------------------------------------------------

def test_dotted_overrides_both_spellings_in_order():
    cfg = load_config(DemoConfig, ["model.preset=qwen3-0.6b", "--mesh.train.fsdp=4", "mesh.train.tp=2",
                                   "--model.dtype=bfloat16", "seed=3", "seed=5"])
    assert cfg == dataclasses.replace(
        DemoConfig(), model=ModelSection(preset="qwen3-0.6b", dtype="bfloat16"),
        mesh=MeshSection(train=LayoutSection(fsdp=4, tp=2)), seed=5)


def test_overrides_apply_on_top_of_the_yaml_file(tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text("mesh:\n  train:\n    tp: 4\nbatch: 2\n")
    assert load_config(DemoConfig, ["mesh.train.fsdp=2"], default_yaml=DEMO_YAML).mesh.train == \
        LayoutSection(dp=1, fsdp=2, tp=2)
    # --config replaces the default file; keys it leaves out keep the dataclass defaults.
    for argv in (["--config", str(other), "batch=4"], [f"--config={other}", "--batch=4"]):
        cfg = load_config(DemoConfig, argv, default_yaml=DEMO_YAML)
        assert cfg == dataclasses.replace(DemoConfig(), mesh=MeshSection(train=LayoutSection(tp=4)), batch=4)
    # A section-valued override merges into the section.
    cfg = load_config(DemoConfig, ["mesh.train={fsdp: 8, tp: 1}"], default_yaml=DEMO_YAML)
    assert cfg.mesh.train == LayoutSection(dp=1, fsdp=8, tp=1) and cfg.mesh.rollout_tp == 2


def test_values_are_read_by_field_type():
    cfg = load_config(DemoConfig, ["run_dir=010", "model.hf_path=/ckpt/010", "model.preset=tiny-qwen2"])
    assert (cfg.run_dir, cfg.model.hf_path, cfg.model.preset) == ("010", "/ckpt/010", "tiny-qwen2")
    assert load_config(DemoConfig, ["model.hf_path=/x", "model.hf_path=null"]).model.hf_path is None


@pytest.mark.parametrize("argv, key, words", [
    (["model.bogus=1"], "model.bogus", ["unknown key", "preset, hf_path, dtype"]),
    (["--bogus=1"], "bogus", ["unknown key", "model, mesh, seed"]),
    (["mesh.train.fsdpp=2"], "mesh.train.fsdpp", ["valid keys under mesh.train: dp, fsdp, tp"]),
    (["model.preset.name=x"], "model.preset.name", ["not a section"]),
    (["model.preset=qwen9"], "model.preset", ["qwen9", "valid choices"] + sorted(PRESETS)),
    (["model.dtype=float64"], "model.dtype", ["float64", "valid choices"] + list(DTYPES)),
    (["mesh.train.fsdp=-1"], "mesh.train.fsdp", [">= 1", "-1"]),
    (["mesh.train.dp=0"], "mesh.train.dp", [">= 1"]),
    (["mesh.rollout_tp=0"], "mesh.rollout_tp", [">= 1"]),
    (["mesh.train={tp: 0}"], "mesh.train.tp", [">= 1"]),
    (["mesh.train.tp=2.5"], "mesh.train.tp", ["expected int", "2.5"]),
    (["mesh.train.tp=two"], "mesh.train.tp", ["expected int", "two"]),
    (["mesh.train.tp=true"], "mesh.train.tp", ["expected int", "bool"]),
    (["batch="], "batch", ["expected int"]),
    (["run_dir="], "run_dir", ["non-empty"]),
    (["model=3"], "model", ["expected a mapping"]),
    (["--config", "/no/such.yaml"], "--config", ["/no/such.yaml"]),
    (["--config"], "--config", ["needs a file"]),
    (["model.preset"], "", ["key=value"]),
])
def test_bad_command_lines_name_the_key(argv, key, words):
    err = config_error(load_config, DemoConfig, argv, DEMO_YAML)
    assert isinstance(err, ValueError) and err.key == key
    for word in words:
        assert word in str(err)


@pytest.mark.parametrize("text, key, words", [
    ("mesh:\n  train:\n    fsdpp: 2\n", "mesh.train.fsdpp", ["unknown key", "dp, fsdp, tp"]),
    ("model:\n  preset: 3\n", "model.preset", ["expected str", "quote"]),
    ("model:\n  dtype: [float32]\n", "model.dtype", ["expected str", "list"]),
    ("mesh:\n  rollout_instances: '4'\n", "mesh.rollout_instances", ["expected int", "str"]),
    ("model:\n", "model", ["expected a mapping"]),
    ("model: {preset: [\n", "", ["cannot parse YAML"]),
])
def test_bad_yaml_names_the_key(tmp_path, text, key, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    err = config_error(load_config, DemoConfig, ["--config", str(path)])
    assert err.key == key
    for word in words + [str(path)]:
        assert word in str(err)


def test_direct_construction_validates():
    assert "valid choices" in str(config_error(ModelSection, "nope"))
    assert config_error(ModelSection, "tiny-qwen3", None, "int8").key == "dtype"
    assert config_error(LayoutSection, 1, 1, -2).key == "tp"
    assert config_error(LayoutSection, 1, True, 1).key == "fsdp"
    assert config_error(DemoConfig, ModelSection(), MeshSection(), -1).key == "seed"


def test_a_section_of_another_class_is_refused_by_key():
    """A train config built in code with the generate config's sampling section as its `rollout` (which lacks
    tail_batching) is refused naming the key, not by an AttributeError deep in a later check."""
    from jaxrl.config.generate import EngineSection, SamplingSection
    from jaxrl.config.train import TrainConfig
    from jaxrl.config.train_rollout import TrainEngineSection, TrainSamplingSection

    for key, wrong, right in (("rollout", SamplingSection(), TrainSamplingSection()),
                              ("engine", EngineSection(), TrainEngineSection())):
        with pytest.raises(ConfigError, match=f"expected a {type(right).__name__}") as e:
            TrainConfig(**{key: wrong})
        assert e.value.key == key
        assert getattr(TrainConfig(**{key: right}), key) == right


def test_parse_cli_exits_2_without_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        parse_cli(DemoConfig, ["model.preset=nope"], default_yaml=DEMO_YAML, prog="demo")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("demo: error: model.preset:") and "tiny-qwen3" in err and "Traceback" not in err
    assert parse_cli(DemoConfig, ["seed=1"], default_yaml=DEMO_YAML) == dataclasses.replace(DEMO_RECIPE, seed=1)


def help_text(capsys, main, argv=("--help",)) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 0
    return capsys.readouterr().out


def test_parse_cli_help_lists_every_key_with_its_resolved_value(capsys):
    out = help_text(capsys, lambda argv: parse_cli(DemoConfig, argv, default_yaml=DEMO_YAML, prog="demo"),
                    ["--help", "seed=9", "mesh.train.tp=1"])
    assert out.startswith("usage: demo [--config FILE] [key=value ...]")
    rows = [line.split(" = ")[0].strip() for line in out.splitlines() if line.startswith("  ") and " = " in line]
    assert rows == ["seed", "prompt_len", "new_tokens", "batch", "run_dir", "model.preset", "model.hf_path",
                    "model.dtype", "model.sliding_window", "model.lora.rank", "model.lora.alpha", "model.lora.dropout",
                    "model.lora.targets", "model.lora.adapter", "mesh.rollout_tp", "mesh.rollout_instances", "mesh.train.dp", "mesh.train.fsdp",
                    "mesh.train.tp"]
    for row in ("  seed = 9", "  mesh.train.fsdp = 4", "  mesh.train.tp = 1", "  model.hf_path = null"):
        assert row + "\n" in out or row + " " in out, row
    out = help_text(capsys, lambda argv: parse_cli(DemoConfig, argv, prog="demo", flags="[--fast]",
                                                   examples=["seed=3 'mesh.train={tp: 2}'"]))
    assert out.startswith("usage: demo [--config FILE] [--fast] [key=value ...]\n")
    assert "\nexamples:\n  demo seed=3 'mesh.train={tp: 2}'\n\n" in out


def _entry_points():
    from jaxrl import demo, generate
    from jaxrl.config import GenerateConfig, TrainConfig
    from jaxrl.train import __main__ as train

    return [(train.main, TrainConfig, "quickstart.yaml"), (generate.main, GenerateConfig, "generate.yaml"),
            (demo.main, DemoConfig, "demo.yaml")]


def _description(out: str, key: str) -> str:
    """The description `--help` prints for dotted key (a `key = value   description` row) or section."""
    for line in out.splitlines():
        if line.startswith(f"{key}: "):
            return line.removeprefix(f"{key}: ")
        if line.startswith(f"  {key} = "):
            return line.removeprefix(f"  {key} = ").partition("   ")[2].strip()
    raise AssertionError(f"{key} not in --help")


@pytest.mark.parametrize("i", range(3), ids=["train", "generate", "demo"])
def test_help_describes_keys_from_comments_and_docstrings(capsys, i):
    main, cls, _ = _entry_points()[i]
    out = help_text(capsys, main)
    expected = {
        "train": {"algo.group_size": "samples per prompt", "engine.num_pages": "explicit pool size",
                  "profile_steps": "jax.profiler trace", "rewards": "How responses are scored",
                  "warm_start.optim": "AdamW with linear warm-up"},
        "generate": {"engine.prefill_chunk": "prompt tokens per row per prefill call", "sampling": "Per-request sampling",
                     "model": "Which model to run"},
        "demo": {"mesh.train": "A device layout", "mesh": "How devices are used"},
    }[["train", "generate", "demo"][i]]
    for key, words in expected.items():
        assert words in _description(out, key), key
    from jaxrl.config.loading import undocumented_keys

    assert not set(expected) & set(undocumented_keys(cls))


@pytest.mark.parametrize("i", range(3), ids=["train", "generate", "demo"])
def test_every_example_in_help_loads(capsys, i):
    main, cls, yaml_name = _entry_points()[i]
    out = help_text(capsys, main)
    prog = out.splitlines()[0].removeprefix("usage: ").partition(" [")[0]
    assert prog.startswith("python -m jaxrl.")
    examples = out.partition("\nexamples:\n")[2].partition("\n\n")[0].splitlines()
    assert examples, "--help shows no examples"
    keys = {line.split(" = ")[0].strip() for line in out.splitlines() if line.startswith("  ") and " = " in line}
    for line in examples:
        assert line.startswith(f"  {prog} "), line
        args = shlex.split(line.removeprefix(f"  {prog} "))
        assert args
        load_config(cls, args, default_yaml=CONFIGS_DIR / yaml_name)    # raises ConfigError if not
    # Every dotted key the help text mentions as key=value is a key of this entry point's config.
    for key in re.findall(r"(?<![\w.-])-{0,2}([a-z_]+(?:\.[a-z_]+)+)=", out):
        assert any(k == key or k.startswith(key + ".") for k in keys), key


# -- build helpers -----------------------------------------------------------------------------------

def test_model_section_builds():
    assert ModelSection(preset="qwen3-0.6b").model_config() == PRESETS["qwen3-0.6b"]
    for name in DTYPES:
        assert ModelSection(dtype=name).jnp_dtype().name == name


def test_hf_path_wins_over_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
        "tie_word_embeddings": True}))
    section = ModelSection(preset="tiny-qwen3", hf_path=str(tmp_path))
    cfg = section.model_config()
    assert isinstance(cfg, ModelConfig) and cfg == config_from_hf(str(tmp_path)) != PRESETS["tiny-qwen3"]
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.tie_embeddings) == \
        ("qwen3", 256, 32, 64, 1, 4, 2, 8, 10000.0, 128, True)


def test_layout_section_builds():
    layout = LayoutSection(dp=1, fsdp=4, tp=2).build()
    assert isinstance(layout, Layout) and (layout.dp, layout.fsdp, layout.tp) == (1, 4, 2)


def test_train_config_choices_come_from_the_algos_registries():
    from jaxrl import algos
    from jaxrl.config import train

    assert train.AGGREGATIONS == tuple(algos.AGGREGATIONS)
    assert train.KL_ESTIMATORS == tuple(algos.KL_ESTIMATORS)
    assert train.ADVANTAGES == tuple(algos.ADVANTAGE_ESTIMATORS)      # gae: PPO with a critic (the ppo graph)


def test_trainer_section_validates_forward_options():
    from jaxrl.config import train

    assert train.TrainConfig().trainer == train.TrainerSection(remat="dots", attention_impl="xla")
    cfg = load_config(train.TrainConfig, ["trainer.remat=layer", "trainer.attention_impl=pallas"])
    assert cfg.trainer == train.TrainerSection(remat="layer", attention_impl="pallas")
    err = config_error(train.TrainerSection, "full")
    assert "remat" in str(err) and "none, layer, dots" in str(err)
    err = config_error(lambda: train.TrainerSection(attention_impl="cudnn"))
    assert "attention_impl" in str(err) and "xla, pallas" in str(err)


def test_model_sliding_window_override():
    from jaxrl.config.sections import ModelSection

    assert ModelSection(preset="tiny-char").model_config().sliding_window is None
    assert ModelSection(preset="tiny-char", sliding_window=16).model_config().sliding_window == 16
    err = config_error(ModelSection, "tiny-char", None, "float32", 0)
    assert "sliding_window" in str(err)
    with pytest.raises(ValueError, match="Llama has no sliding window"):
        ModelSection(preset="tiny-llama", sliding_window=8).model_config()


@pytest.mark.parametrize("key,value", [("algo.kl_coef", "-0.1"), ("algo.clip_low", "-0.2"), ("algo.gamma", "-1"),
                                       ("algo.lam", "1.5")])
def test_negative_coefficients_are_refused(key, value):
    with pytest.raises(ConfigError, match=key.split(".")[1]):
        load_config(CONFIG_CLASSES["quickstart.yaml"], [f"{key}={value}"])
