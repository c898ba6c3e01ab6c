"""Top-level config of the foundation demo, `python -m jaxrl.demo` (recipe: configs/demo.yaml)."""

from __future__ import annotations

import dataclasses

from .base import Section, check_int, check_str
from .sections import MeshSection, ModelSection


@dataclasses.dataclass(frozen=True)
class DemoConfig(Section):
    """Model, device layouts, and a small generation workload.

    The defaults run on one device; configs/demo.yaml is the 8-device recipe (train FSDP4×TP2,
    rollout 4 instances of TP2). Checked later, where the facts are known, not here: that the layouts
    fit the devices present and that `batch` divides the sharded axes (the mesh and sharding code raise
    both), and that prompt_len + new_tokens fits the model's context (hf_path configs are only read
    by `model.model_config()`).
    """

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    seed: int = 0                        # weights and prompts
    prompt_len: int = 16                 # tokens per random prompt
    new_tokens: int = 16                 # tokens generated per prompt
    batch: int = 8                       # prompts
    run_dir: str = "runs/demo"           # where the demo writes its report

    def __post_init__(self):
        check_int("seed", self.seed, minimum=0)
        for name in ("prompt_len", "new_tokens", "batch"):
            check_int(name, getattr(self, name), minimum=1)
        check_str("run_dir", self.run_dir)
