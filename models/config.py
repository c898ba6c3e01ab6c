"""Model configuration for the Llama-3.x / Qwen2.5 / Qwen3 decoder family, and named presets.

One frozen dataclass covers the three families; they differ only in a few switches:

| family  | q/k/v bias | q/k RMSNorm | RoPE scaling        | tied embeddings        |
|---------|------------|-------------|---------------------|------------------------|
| llama   | no*        | no          | llama3 (3.1+)       | 3.2-1B/3B only         |
| qwen2   | yes        | no          | none                | small models           |
| qwen3   | no*        | yes         | none                | 0.6B-4B                |

(* `attention_bias` in the HF config can turn it on.) `head_dim` is its own field: Qwen3 uses 128 with
hidden/heads = 64 for the 0.6B model.

`sliding_window` (W, default None = full attention) restricts every layer's attention to the W most
recent keys, the query's own included (HF semantics: key s is visible to query q when q - s < W); every
attention path honours it (train forward, block forward, prefill, paged decode, Pallas kernels). It
maps to HF's `use_sliding_window: true, sliding_window: W, max_window_layers: 0` (all layers windowed);
per-layer mixes are not supported. MetroRLHF's zero-reward shortcut skips blocks outside it
(`jaxrl.train.blockwise`).
"""

from __future__ import annotations

import dataclasses

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"bad llama3 rope scaling {self}: need factor > 0 and high_freq_factor > low_freq_factor > 0")


# LoRA targets by their PEFT / HF module names -> our `Layers` field names.
LORA_TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
                "up_proj": "w_up", "down_proj": "w_down"}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the projections (Hu et al. 2021): W x -> W x + (alpha / rank) B(A x), W frozen.

    `targets` are PEFT's module names (`LORA_TARGETS`; default all seven projections, PEFT's "all-linear" for
    these models). `dropout` on the adapter input is 0 for RL (the rollout and the update must compute the same
    policy); a non-zero value is refused rather than applied to one side only.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(LORA_TARGETS)

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora.rank={self.rank!r} must be a positive int")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha!r} must be > 0")
        if self.dropout != 0:
            raise ValueError(f"lora.dropout={self.dropout!r}: only 0 is supported (an RL update must score tokens "
                             "with the policy that sampled them; adapter dropout would make the two differ)")
        object.__setattr__(self, "targets", tuple(self.targets))
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora.targets={list(self.targets)}: a non-empty list of distinct names from "
                             f"{', '.join(LORA_TARGETS)}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    @property
    def fields(self) -> tuple[str, ...]:
        """The targeted `Layers` fields (wq, ...)."""
        return tuple(LORA_TARGETS[t] for t in self.targets)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None     # attention window W (all layers); None: full causal attention
    lora: LoraConfig | None = None        # low-rank adapters (models.lora); None: full-parameter weights

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r}; valid choices: {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or
                                                isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be a positive int or None")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} and rms_norm_eps={self.rms_norm_eps} must be > 0")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(f"lora={self.lora!r} must be a LoraConfig or None")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def param_count(self) -> int:
        """Number of parameters (tied embeddings counted once)."""
        h, d, L = self.hidden_size, self.head_dim, self.num_layers
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        per_layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + L * per_layer + h + head


_QWEN3 = dict(architecture="qwen3", vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
              max_position_embeddings=40960, qk_norm=True)
_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    # Real shapes (from the published config.json files); no weights are downloaded.
    "qwen3-0.6b": ModelConfig(**_QWEN3, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                              num_kv_heads=8, tie_embeddings=True),
    "qwen3-8b": ModelConfig(**_QWEN3, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                            num_kv_heads=8),
    "qwen3-14b": ModelConfig(**_QWEN3, hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40,
                             num_kv_heads=8),
    "llama3.1-8b": ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                               num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500_000.0,
                               rope_scaling=_LLAMA31_SCALING, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "qwen2.5-7b": ModelConfig(architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1_000_000.0,
                              rms_norm_eps=1e-6, max_position_embeddings=32768, qkv_bias=True),
    "qwen2.5-14b": ModelConfig(architecture="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                               num_layers=48, num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
                               rms_norm_eps=1e-5, max_position_embeddings=131072, qkv_bias=True),
    "qwen2.5-32b": ModelConfig(architecture="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                               num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
                               rms_norm_eps=1e-5, max_position_embeddings=131072, qkv_bias=True),
    # Tiny test/demo models: same code paths (GQA, head_dim != hidden/heads, bias, qk-norm, rope scaling, tying).
    "tiny-qwen3": ModelConfig(architecture="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32, rope_theta=1_000_000.0,
                              max_position_embeddings=2048, qk_norm=True, tie_embeddings=True),
    # The quickstart's policy: Qwen3-shaped, vocabulary sized for the built-in character tokenizer.
    "tiny-char": ModelConfig(architecture="qwen3", vocab_size=128, hidden_size=128, intermediate_size=384,
                             num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10_000.0,
                             max_position_embeddings=512, qk_norm=True, tie_embeddings=True),
    "tiny-llama": ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=160,
                              num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16, rope_theta=500_000.0,
                              rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=64),
                              rms_norm_eps=1e-5, max_position_embeddings=2048),
    "tiny-qwen2": ModelConfig(architecture="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1_000_000.0,
                              max_position_embeddings=2048, qkv_bias=True),
}


def preset(name: str) -> ModelConfig:
    """The named preset; raises with the valid names on an unknown one."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid choices: {', '.join(sorted(PRESETS))}") from None


