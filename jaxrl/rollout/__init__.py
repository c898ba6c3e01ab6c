"""Rollout engine: paged-KV continuous batching on sharded instances.

    from jaxrl.rollout import generate, SamplingParams
    outs = generate(cfg, weights, prompts, SamplingParams(max_new_tokens=32, temperature=0.0), tp=1, instances=1)
"""

from .instance import Completion, Instance
from .sampling import SamplingParams
from .service import RolloutService, generate

__all__ = ["Completion", "Instance", "RolloutService", "SamplingParams", "generate"]
