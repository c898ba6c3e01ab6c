"""Typed configuration: nested frozen dataclasses, YAML as their serialised form, dotted CLI overrides.

    from jaxrl.config import DemoConfig, parse_cli, CONFIGS_DIR
    cfg = parse_cli(DemoConfig, default_yaml=CONFIGS_DIR / "demo.yaml")   # exits 2 on a bad config
    model_cfg, layout = cfg.model.model_config(), cfg.mesh.train.build()

`python -m jaxrl.demo --config configs/demo.yaml model.preset=qwen3-0.6b mesh.train.fsdp=4` —
see loading.py for the command-line grammar and base.py for how to add a section.
"""

from .base import ConfigError, Section, check_choice, check_float, check_int, check_str, decode
from .demo import DemoConfig
from .generate import EngineSection, GenerateConfig, SamplingSection
from .train import TrainConfig
from .loading import CONFIGS_DIR, from_yaml, from_yaml_file, load_config, parse_cli, to_yaml
from .sections import DTYPES, LayoutSection, MeshSection, ModelSection
from .eval_run import EvalConfig

# Every YAML file in configs/ and the config class it is the serialised form of (tests check both ways).
CONFIG_CLASSES: dict[str, type[Section]] = {
    "demo.yaml": DemoConfig,
    "generate.yaml": GenerateConfig,
    "eval.yaml": EvalConfig,
    "quickstart.yaml": TrainConfig,
    "grpo_qwen3_0.6b_math.yaml": TrainConfig,
    "all_mechanisms.yaml": TrainConfig,          # written by scripts/composition.py
    "all_mechanisms_async.yaml": TrainConfig,
    "multiturn.yaml": TrainConfig,               # multi-turn with the calculator tool (the calc task)
    "smollm2_arith.yaml": TrainConfig,           # SmolLM2-135M-Instruct on the arith task (docs/real_model.md)
}

__all__ = [
    "CONFIGS_DIR", "CONFIG_CLASSES", "DTYPES",
    "ConfigError", "Section", "check_choice", "check_float", "check_int", "check_str", "decode",
    "DemoConfig", "EngineSection", "EvalConfig", "GenerateConfig", "TrainConfig", "SamplingSection", "LayoutSection", "MeshSection", "ModelSection",
    "from_yaml", "from_yaml_file", "load_config", "parse_cli", "to_yaml",
]
