"""PAT latency profiles that force the controller's hand (now in jaxrl.testing, shared with scripts/): decode latency falling or rising
10x per TP doubling and nearly free switches, for the tiny-qwen3 shapes."""

from jaxrl.testing import PROFILE_CFG as CFG, forcing_profile  # noqa: F401 (the tests' names; scripts share them)
