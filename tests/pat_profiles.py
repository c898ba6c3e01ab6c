"""PAT latency profiles that force the controller's hand (tests only): decode latency falling or rising
10x per TP doubling and nearly free switches, for the tiny-qwen3 shapes."""

from jaxrl.rollout.adaptive_tp import LayoutProfile, Profile
from models import PRESETS

CFG = PRESETS["tiny-qwen3"]


def forcing_profile(prefer: str) -> Profile:
    """Decode latency falling (prefer="large") or rising (prefer="small") 10x per TP doubling; switches
    nearly free: the controller switches at its first check towards the preferred end of its candidates."""
    layouts = {}
    for tp in (1, 2, 4, 8):
        f = (1 / tp) if prefer == "large" else tp
        dec = [(b, n, 1.0 * f ** 3.3 * (1 + b * n / 1e4)) for b in (1, 8, 64) for n in (8, 64, 512)]
        pre = [(b, n, 1e-6 * b * n) for b in (1, 8, 64) for n in (8, 64, 512)]
        layouts[tp] = LayoutProfile(tp, dec, pre, 0.0)
    rs = {f"{a}->{b}": 1e-6 for a in layouts for b in layouts if a != b}
    return Profile({"model": "forcing"}, layouts, 1e12, rs, layers=CFG.num_layers,
                   kv_bytes_per_token_layer=2 * CFG.num_kv_heads * CFG.head_dim * 4)
