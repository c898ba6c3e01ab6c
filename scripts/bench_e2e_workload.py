"""The shared inputs of `scripts/bench_e2e.py`: one HF directory (Qwen3 weights, a 32000-word tokenizer), a
prompts JSONL and a reward module, which both TRL and `python -m jaxrl.train` load.

    paths = build(Path("/tmp/e2e/58m"), "58m")      # {"model": dir, "prompts": file, "reward": "module.py:fn"}

**A long tail from random weights.** A trained model's response lengths are what make a step long-tailed; a
random Qwen3 samples every token about equally often and so (almost) never stops. The weights are set so
that each step samples end-of-sequence with probability `P_EOS` and any other token uniformly:

- every embedding (and lm_head column) has the same component `C` along hidden dimension 0 and small noise
  (std `NOISE`) elsewhere; the layers' output projections (o_proj, down_proj) are scaled down by
  `LAYER_SCALE`, so the residual stream stays close to the embedding and the final norm's output h has a
  nearly constant h_0 = g_0 · C / rms(x);
- every logit is then h_0 · C + (noise), the same for every token, except end-of-sequence, whose lm_head
  column has C + δ along dimension 0: its logit is larger by h_0 · δ = ln((V − 1) · P_EOS / (1 − P_EOS)).

Lengths are then geometric with mean ≈ 1 / P_EOS = 66, capped at max_new_tokens: the issue's workload. The
FLOPs of every matmul are what they are for any values; only the lengths depend on the weights, and both
systems sample from the same distribution (bench_e2e.json records each side's mean response length).

Prompts: `PROMPT_LEN` words each, drawn from the vocabulary (no chat template: data.chat=false and TRL's
plain "prompt" column). Reward: the share of the response's words whose index is even (`reward`), dense in
[0, 1], the same text function for both.

**The real model** (`build_real`, workload "smollm2"): SmolLM2-135M-Instruct as a float32 HF directory
(`python -m models.fetch smollm2-135m-instruct`, cached; `checkpoints/smollm2-135m-instruct` is reused when
it is there), the built-in `arith` task's chat prompts ("What is 23 + 48?", rendered with the model's chat
template by both systems: data.chat=true, and TRL's conversational "prompt" column) and its reward (1 when
the last integer of the response is the sum), written out as a text function so TRL's process loads it
without importing jaxrl.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench_train import MODELS as TRAIN_MODELS
from models import ModelConfig, init, load_tokenizer, save_hf

PAD, EOS = "<pad>", "<|eos|>"
P_EOS = 1 / 66
C, NOISE, LAYER_SCALE = 1.0, 0.01, 1e-3
PROMPT_LEN = 24
PROMPTS = 256

MODELS = {**TRAIN_MODELS,   # scripts/bench_train.py's 3.2m and 58m shapes (also bench_rollout's), and a smoke-test size
          "tiny": dataclasses.replace(TRAIN_MODELS["3.2m"], vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_layers=2, head_dim=16)}

REWARD_MODULE = '''"""bench_e2e's reward (written by scripts/bench_e2e_workload.py): the share of the response's words whose
index is even. jaxrl calls reward(response, answer, task); TRL through bench_e2e_trl.py's wrapper."""


def reward(response, answer, task):
    words = [w for w in response.split() if w.startswith("w") and w[1:].isdigit()]
    return sum(int(w[1:]) % 2 == 0 for w in words) / len(words) if words else 0.0
'''


REAL_MODEL = "smollm2-135m-instruct"
REAL_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / REAL_MODEL
REAL_REWARD_MODULE = r'''"""bench_e2e's real-model reward (written by scripts/bench_e2e_workload.py): 1 when the last integer of
the response (thousands commas allowed) is the answer, else 0: jaxrl.data.tasks.final_number_score (the
`arith` task's score), copied so that TRL's process need not import jaxrl."""
import re

_INT = re.compile(r"-?\d[\d,]*")


def reward(response, answer, task):
    found = _INT.findall(response)
    return float(bool(found) and found[-1].replace(",", "") == answer.strip())
'''


def words(vocab: int) -> list[str]:
    """The tokenizer's vocabulary: padding (id 0), end of sequence (id 1), then words w2 .. w{vocab-1}."""
    return [PAD, EOS] + [f"w{i}" for i in range(2, vocab)]


def write_tokenizer(directory: Path, vocab: int) -> None:
    """A word-level tokenizer.json (whitespace split, decoded joined by spaces) and its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words(vocab))}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)      # joins words with spaces
    tok.add_special_tokens([PAD, EOS])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "pad_token": PAD, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}))


def long_tail_weights(cfg: ModelConfig, seed: int = 0):
    """Random Qwen3 weights whose next-token distribution is P_EOS on end-of-sequence and uniform elsewhere
    (module docstring)."""
    w = init(jax.random.key(seed), cfg, jnp.float32)
    rng = np.random.default_rng(seed)
    E = cfg.hidden_size
    emb = rng.normal(size=(cfg.vocab_size, E)).astype(np.float32) * NOISE
    emb[:, 0] = C
    # h_0 = g_0 · C / rms(x) with x the embedding: rms = sqrt((C² + (E − 1) NOISE²) / E), g_0 = 1.
    h0 = C / math.sqrt((C ** 2 + (E - 1) * NOISE ** 2) / E)
    delta = math.log((cfg.vocab_size - 1) * P_EOS / (1 - P_EOS)) / h0
    layers = w.layers
    layers = type(layers)(**{**vars(layers), "wo": layers.wo * LAYER_SCALE, "w_down": layers.w_down * LAYER_SCALE})
    if cfg.tie_embeddings:
        emb[1, 0] = C + delta
        return type(w)(embed=jnp.asarray(emb), layers=layers, final_norm=w.final_norm, lm_head=None)
    head = rng.normal(size=(E, cfg.vocab_size)).astype(np.float32) * NOISE
    head[0, :] = C
    head[0, 1] = C + delta
    return type(w)(embed=jnp.asarray(emb), layers=layers, final_norm=w.final_norm, lm_head=jnp.asarray(head))


def build(directory: Path, model: str, *, seed: int = 0) -> dict:
    """Write the model directory, the prompts and the reward module under `directory` (skipped when they are
    there already, from the same model and seed); returns their paths."""
    directory = Path(directory)
    cfg = MODELS[model]
    paths = {"model": directory / "model", "prompts": directory / "prompts.jsonl",
             "reward": f"{directory / 'e2e_reward.py'}:reward"}
    stamp = directory / "built.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == {"model": model, "seed": seed}:
        return paths
    write_tokenizer(paths["model"], cfg.vocab_size)        # then generation_config.json names its EOS and padding
    save_hf(paths["model"], cfg, long_tail_weights(cfg, seed), tokenizer=load_tokenizer(paths["model"]))
    rng = np.random.default_rng(seed + 1)
    rows = [{"prompt": " ".join(f"w{i}" for i in rng.integers(2, cfg.vocab_size, PROMPT_LEN)), "answer": "even",
             "task": "e2e"} for _ in range(PROMPTS)]
    paths["prompts"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "e2e_reward.py").write_text(REWARD_MODULE)
    stamp.write_text(json.dumps({"model": model, "seed": seed}))
    return paths


def build_real(directory: Path, *, examples: int = 256, seed: int = 0) -> dict:
    """The real-model workload under `directory` (module docstring): the converted SmolLM2 directory, the
    `arith` prompts (JSONL: prompt, answer, task) and the reward module. Returns their paths, the model's
    config and the chat-rendered prompts' mean and longest token counts (the FLOP count's prompt length)."""
    from jaxrl.data.tasks import make_suite
    from models import config_from_hf
    from models.fetch import fetch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = fetch(REAL_MODEL, REAL_CHECKPOINT, progress=True)      # idempotent: a complete directory is kept
    rows = [{"prompt": ex.prompt, "answer": ex.answer, "task": ex.task} for ex in make_suite(["arith"], examples, seed)]
    paths = {"model": model, "prompts": directory / "prompts.jsonl", "reward": f"{directory / 'e2e_reward.py'}:reward"}
    paths["prompts"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "e2e_reward.py").write_text(REAL_REWARD_MODULE)
    tok = load_tokenizer(model)
    lens = [len(tok.encode(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}]))) for r in rows]
    return dict(paths, cfg=config_from_hf(model), prompt_len=float(np.mean(lens)), prompt_len_max=max(lens))
