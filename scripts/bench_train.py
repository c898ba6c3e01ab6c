"""jaxrl's RL train step against a torch `transformers` training step: same weights, same batch, same loss.

    python scripts/bench_train.py                       # -> scripts/results/bench_train.json (a few minutes)
    python scripts/bench_train.py --quick --out /tmp/t.json   # tiny shapes, one repeat (a smoke test)

jaxrl side: the fused step the trainer runs with trainer.micro_batch_tokens=null and algo.mini_batches=1
(`Trainer._update_fused`; the default micro-batched `Updater` runs the same gradient computation and
update as separate executables), i.e. `jaxrl.train.step.make_train_step(cfg, spec, tx, 1)` with `spec =
LossSpec(kind="rl", clip_low=0.2, clip_high=0.28, kl_coef=0.05, kl_estimator="k3")`: GRPO clipped token
loss with the on-policy ratio (`old_logp` absent, ρ = exp(logp − stop_gradient(logp)) = 1), k3 KL to
reference log-probs computed beforehand with `make_logprob_fn` on a perturbed copy of the weights (the
trainer computes them outside the step too, so neither side times them), log-probs from the chunked
vocabulary projection (`kernels.logprobs`), and `tx` from `OptimSection.build` (AdamW, decay on the
matrices only, global-norm clipping at 1.0). The batch is `jaxrl.train.batch.pack` of GRPO samples
(advantages from the `jaxrl.algos` registry) with "token-mean" weights folded as the trainer folds them
(`algos.folded_token_weights`: 1 / total response tokens), so the step runs with denominator 1.0. It is
compiled ahead of time once (`.lower().compile()`, which also gives `memory_analysis()`) and that
executable is called.

torch side: `transformers` Qwen3ForCausalLM built from `models.config_to_hf(cfg)` with the very same
weights (`models.hf.tensor_map`, the mapping `save_hf` writes), float32, sdpa attention, training mode
(no dropout in Qwen3). The same loss written in torch: full logits, logp = z[target] − logsumexp(z),
ratio = exp(logp − logp.detach()), PPO clip with the same clip_low/high, k3 KL = expm1(d) − d with
d = ref_logp − logp times kl_coef, Σ weights · ℓ over the loss mask; the step's metrics too (mean
entropy under no_grad, kl, clip fraction, nll), as jaxrl's step returns them; then `loss.backward()`,
`torch.nn.utils.clip_grad_norm_(1.0)` and `torch.optim.AdamW` with the same lr/betas/eps/weight decay
(decay on the 2-D tensors = jaxrl.train.optim's decayed names). torch.set_num_threads(2).

Packing: torch does not pack. It gets each sequence in its own row, right-padded, positions 0..L-1 over
the row and no attention mask (causal attention never reaches the padding that follows a sequence; padded
targets are masked out of the loss). Every array it gets (tokens, targets, mask, advantages, weights,
reference log-probs) is cut out of jaxrl's packed batch, so both compute the same quantities. The
agreement batch packs ragged sequences several to a row (segment ids, restarted positions) on the jaxrl
side; the timed batches hold one sequence per row (32 × 82 = 18 prompt + 64 response tokens; 8 × 1024 =
256 + 768), where packed and padded are the same tokens, so both sides do the same work.

Agreement (before any timing; exit status 1 and no timing if it fails), per model: one step from the
same weights on the packed ragged batch, on-policy (what the trainer runs) and off-policy (`old_logp`
from another perturbed copy, so the clip branches are live). Compared: the loss and metrics, the
log-probs at the start weights, and every parameter after the step, per tensor as max |Δ| divided by the
largest update of that tensor (Adam's first step moves every weight by about lr, so this is the error
relative to the step itself) and as ‖Δ‖ / ‖update‖; tolerances are fixed in `TOLERANCES` (see `OPTIM` for
why lr = 1e-3 and eps = 1e-5 make this comparison well conditioned).

Timing: warm-up runs (untimed) of both, then `--repeats` interleaved repeats (jaxrl, torch, jaxrl,
torch, ...) so both see the same machine state; the best and the median are kept (`jaxrl_s`/`torch_s`
are the best, `ratio = torch_s / jaxrl_s`). XLA compilations during the timed loop are counted
(`jaxrl.runtime.CompileCounter`; must be 0). FLOPs per step (`step_flops`; forward + backward = 3 × the
forward's 2 FLOPs per multiply-add, each computation counted once):

    6 · N_layers_matmul · T  +  6 · hidden · vocab · T  +  12 · layers · heads · head_dim · rows · P(S)

with T = rows · S the batch's tokens, S the row length, N_layers_matmul the decoder layers' projection
weights (norms left out, the embedding lookup is free), the lm_head as a matmul (tied or not), and P(S)
the (query, key) score entries per row that attention's QKᵀ and PV compute, causally, as the kernel the
step runs computes them (`kernels.attention.attention_chunked`, query chunks of b = `BlockSizes().
block_q_xla` = 128 rows, each over only the keys its causal bound reaches: the diagonal chunk in full,
the strictly-lower chunks, never a fully masked one). With S = n · b + r (0 ≤ r < b):

    P(S) = b² · n(n + 1)/2  +  r · S        (S ≤ b: one chunk, the full S² square)

i.e. S(S + b)/2 when b divides S: 589 824 = 0.5625 · S² at S = 1024, and 82² (the whole square, masked
half included, as computed) at S = 82; `causal_pairs`. Uncounted work the step also does: jaxrl's
chunked log-prob kernel recomputes the lm_head tiles in its backward (one more 2·hidden·vocab·T: the
cost of never holding [T, vocab] logits), and remat "dots" recomputes the attention scores and PV in
the backward (one more 4 · layers · heads · head_dim · rows · P(S)). `torch_gflops` divides the same count
by torch's time, whatever its sdpa kernel computes. `peak_fraction = jaxrl_gflops / peak_gflops.float32`
from `scripts/bench_peak.py`'s `load_peak()`.

Memory: the jaxrl step's compiled temp bytes are checked against `--mem-budget-gib` before it runs; over
the budget it falls back to remat "layer", and the row
says which one ran.

On the CPU only the ratio measured side by side in one run means anything (ARCHITECTURE.md, "Testing
and measuring"); `loadavg_before/after` say how busy the machine was.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl import algos  # noqa: E402
from jaxrl.config.train import OptimSection, TrainerSection  # noqa: E402
from jaxrl.runtime import CompileCounter, cpu_compile_level  # noqa: E402
from jaxrl.train.batch import Sample, pack, pack_rows  # noqa: E402
from jaxrl.train.optim import make_optimizer  # noqa: E402
from jaxrl.train.step import LossSpec, make_logprob_fn, make_train_step  # noqa: E402

from bench_harness import interleaved, write_result  # noqa: E402
from bench_train_torch import TorchStep, hf_tensors, torch_batch, torch_model, torch_tensors, unpack  # noqa: E402
from kernels.attention import BlockSizes  # noqa: E402
from models import ModelConfig, init  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "bench_train.json"

_QWEN3 = dict(architecture="qwen3", vocab_size=32000, rope_theta=1_000_000.0, max_position_embeddings=4096,
              qk_norm=True)
MODELS = {
    "3.2m": ModelConfig(**_QWEN3, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2,
                        head_dim=64, tie_embeddings=True),
    "58m": ModelConfig(**_QWEN3, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4,
                       head_dim=64, tie_embeddings=False),
}
QUICK_MODELS = {"tiny": ModelConfig(architecture="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1_000_000.0,
                                    max_position_embeddings=256, qk_norm=True, tie_embeddings=True)}

OUTPUTS = ("bench_train.json",)  # its files in scripts/results/ (tests/test_docs.py)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """`rows` sequences of `prompt` + `response` tokens, one per packed row (GRPO groups of `group`)."""

    name: str
    rows: int
    prompt: int
    response: int
    group: int

    @property
    def seq_len(self) -> int:
        return self.prompt + self.response


BATCHES = (BatchShape("32x82", 32, 18, 64, 8), BatchShape("8x1024", 8, 256, 768, 4))
QUICK_BATCHES = (BatchShape("4x24", 4, 8, 16, 2),)

ATTENTION_BLOCK_Q = BlockSizes().block_q_xla      # the query chunk of the step's attention (attention_impl "xla")
FLOPS_FORMULA = (
    "6*N_layers_matmul*T + 6*hidden*vocab*T + 12*layers*heads*head_dim*rows*P(S), T = rows*S tokens, S row "
    "length; P(S) = (query, key) score entries per row that attention_chunked computes causally with query "
    f"chunks of b = {ATTENTION_BLOCK_Q} (diagonal chunks in full, strictly-lower chunks, masked chunks skipped): "
    "P(S) = b^2*n(n+1)/2 + r*S for S = n*b + r, 0 <= r < b (S(S+b)/2 when b divides S; S^2 when S <= b); "
    "norms, the embedding lookup, the log-prob kernel's lm_head recompute and remat's attention recompute not "
    "counted")

SPEC = LossSpec(kind="rl", clip_low=0.2, clip_high=0.28, kl_coef=0.05, kl_estimator="k3")
# lr and eps make the weight comparison well conditioned (timing does not depend on them): Adam's first step
# moves each weight by lr·g/(|g| + eps), so a gradient near eps magnifies float32 noise in g (by up to
# 1/(4·eps) per unit of noise); eps = 1e-5 (PPO's usual Adam epsilon, OpenAI baselines) keeps that to a few
# 1e-3 of the update, and lr = 1e-3 keeps the update far above a weight's float32 spacing (a norm weight
# of 1.0: 1.2e-7, i.e. 1.2e-4 of the update).
OPTIM = OptimSection(lr=1e-3, weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-5, clip_norm=1.0)
AGG = "token-mean"
REF_NOISE, OLD_NOISE = 0.05, 0.3      # relative perturbations: reference policy, off-policy rollout policy
TOLERANCES = {                         # float32 bounds, set once from the error model above
    "loss_rel": 1e-4,                  # |Δloss| / Σ|w·ℓ| (the summed terms: the scale of the summation error)
    "metric_rel": 1e-3,                # kl, entropy, nll, grad_norm (token means / the norm)
    "clip_frac_abs": 0.02,             # a token exactly on a clip edge may go either way
    "logp_abs": 1e-4,                  # per-token log-probs at the start weights (the HF logit parity bound)
    "update_rel": 1e-2,                # max |Δparam| / max |update| per tensor
    "update_l2_rel": 1e-3,             # ‖Δupdate‖ / ‖update‖ per tensor
}


# ---------------------------------------------------------------------------------------------- batches

def grpo_samples(rng: np.random.Generator, vocab: int, n: int, group: int, prompt_len: int,
                 resp_lens: list[int]) -> list[Sample]:
    """`n` samples in groups of `group` sharing a prompt, random tokens, GRPO advantages of random rewards."""
    if n % group:
        raise ValueError(f"{n} samples do not split into groups of {group}")
    prompts = [rng.integers(1, vocab, prompt_len).tolist() for _ in range(n // group)]
    rewards = rng.standard_normal((n // group, group)).astype(np.float32)
    mask = (np.arange(max(resp_lens))[None, :] < np.asarray(resp_lens)[:, None]).astype(np.float32)
    adv = np.asarray(algos.compute_advantages("grpo", rewards=rewards, mask=mask))
    return [Sample(prompts[i // group], rng.integers(1, vocab, m).tolist(), adv[i, :m])
            for i, m in enumerate(resp_lens)]


def packed_batch(samples: list[Sample], pack_len: int, max_new_tokens: int):
    """jaxrl's packed batch (numpy) with token-mean weights folded in, and where each sample sits in it."""
    lengths = [len(s.prompt) + len(s.response) for s in samples]
    resp = np.asarray([len(s.response) for s in samples])
    weights = algos.folded_token_weights(AGG, resp, max_new_tokens, denominator=int(resp.sum()))
    rows = pack_rows(lengths, pack_len)
    where = [None] * len(samples)
    for r, members in enumerate(rows):
        off = 0
        for i in members:
            where[i] = (r, off, lengths[i])
            off += lengths[i]
    return pack(samples, weights, pack_len, rows=rows), where


def perturbed(params, key, scale: float):
    """Each leaf + scale · std(leaf) · N(0, 1) (norm weights, all ones, stay as they are)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys)])


# ---------------------------------------------------------------------------------------------- jaxrl side

def compile_step(cfg: ModelConfig, tx, params, opt_state, batch, budget_bytes: float):
    """The trainer's fused step with the trainer's default `trainer.remat`, compiled ahead of time; falls back to
    remat "layer" when its temp memory is over `budget_bytes`. Returns (executable, remat, temp bytes, compile
    seconds)."""
    for remat in dict.fromkeys((TrainerSection().remat, "layer")):
        step = make_train_step(cfg, dataclasses.replace(SPEC, remat=remat), tx, 1)
        t0 = time.perf_counter()
        exe = step.lower(params, opt_state, batch, 1.0).compile()
        seconds = time.perf_counter() - t0
        temp = exe.memory_analysis().temp_size_in_bytes
        if temp <= budget_bytes or remat == "layer":
            return exe, remat, temp, seconds


def _device(batch: dict[str, np.ndarray]) -> dict:
    return {k: jnp.asarray(v) for k, v in batch.items()}


# ------------------------------------------------------------------------------------------------ agreement

def update_agreement(before: dict, ours: dict, theirs: dict) -> dict:
    """Per tensor: max |ours − theirs| / max |theirs − before| (the error relative to the step's own
    update; an unchanged tensor must then match exactly). `l2_rel`: ‖Δours − Δtheirs‖ / ‖Δtheirs‖.
    `ulp_rel`: one float32 ulp of the tensor's largest entry over the same update, the rounding floor of
    the figure. Returns the largest of each over the tensors ({"max_rel", "worst", "max_l2_rel",
    "worst_l2"}) and "per_tensor"."""
    per = {}
    for name, b in before.items():
        diff = float(np.max(np.abs(ours[name] - theirs[name])))
        upd = float(np.max(np.abs(theirs[name] - b)))
        rel = diff / upd if upd > 0 else (0.0 if diff == 0 else math.inf)
        ulp = float(np.spacing(np.max(np.abs(theirs[name])).astype(np.float32)))
        du, dt = ours[name] - b, theirs[name] - b
        l2 = float(np.linalg.norm(du - dt) / max(np.linalg.norm(dt), 1e-30))
        per[name] = {"max_abs_diff": diff, "max_update": upd, "rel": rel, "l2_rel": l2,
                     "ulp_rel": ulp / upd if upd > 0 else None}
    worst = max(per, key=lambda n: per[n]["rel"])
    worst_l2 = max(per, key=lambda n: per[n]["l2_rel"])
    return {"max_rel": per[worst]["rel"], "worst": worst, "max_l2_rel": per[worst_l2]["l2_rel"], "worst_l2": worst_l2,
            "per_tensor": per}


def check(case: dict, tol: dict = TOLERANCES) -> list[str]:
    """The failed comparisons of one agreement case (empty: it agrees)."""
    bad = []
    if not case["loss_rel"] <= tol["loss_rel"]:
        bad.append(f"loss rel {case['loss_rel']:.2e} > {tol['loss_rel']}")
    for k, v in case["metric_rel"].items():
        if not v <= tol["metric_rel"]:
            bad.append(f"{k} rel {v:.2e} > {tol['metric_rel']}")
    if not case["clip_frac_abs"] <= tol["clip_frac_abs"]:
        bad.append(f"clip_frac abs {case['clip_frac_abs']:.2e} > {tol['clip_frac_abs']}")
    if not case["logp_max_abs_diff"] <= tol["logp_abs"]:
        bad.append(f"logp max abs diff {case['logp_max_abs_diff']:.2e} > {tol['logp_abs']}")
    u = case["update"]
    if not u["max_rel"] <= tol["update_rel"]:
        bad.append(f"update rel {u['max_rel']:.2e} > {tol['update_rel']} ({u['worst']})")
    if not u["max_l2_rel"] <= tol["update_l2_rel"]:
        bad.append(f"update l2 rel {u['max_l2_rel']:.2e} > {tol['update_l2_rel']} ({u['worst_l2']})")
    return bad


def agreement(name: str, cfg: ModelConfig, quick: bool) -> list[dict]:
    """One step of each side from the same weights on a packed ragged batch: on-policy and off-policy."""
    rng = np.random.default_rng(1)
    n, group, prompt, max_resp, pack_len = (6, 3, 6, 12, 32) if quick else (8, 4, 18, 64, 160)
    samples = grpo_samples(rng, cfg.vocab_size, n, group, prompt, rng.integers(3, max_resp + 1, n).tolist())
    packed, where = packed_batch(samples, pack_len, max_resp)
    params = init(jax.random.key(0), cfg, jnp.float32)
    logp_fn = make_logprob_fn(cfg, SPEC)
    batch = _device(packed)
    batch["ref_logp"] = logp_fn(perturbed(params, jax.random.key(1), REF_NOISE), batch)
    start_logp = unpack(np.asarray(logp_fn(params, batch)), where)
    valid = unpack(np.ones_like(packed["tokens"]), where).astype(bool)
    before = hf_tensors(cfg, params)
    cases = []
    for case in ("on_policy", "off_policy"):
        b = dict(batch)
        if case == "off_policy":
            b["old_logp"] = logp_fn(perturbed(params, jax.random.key(2), OLD_NOISE), batch)
        tx, _ = make_optimizer(OPTIM, 1)
        model = torch_model(cfg, params)
        new, _, m = make_train_step(cfg, SPEC, tx, 1)(jax.tree.map(jnp.copy, params), tx.init(params), b, 1.0)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        stats, logp = TorchStep(model, SPEC, OPTIM)(torch_batch({k: np.asarray(v) for k, v in b.items()}, where))
        t = {k: float(v) for k, v in stats.items()}
        upd = update_agreement(before, hf_tensors(cfg, new), torch_tensors(model, before))
        rel = lambda a, r: abs(a - r) / max(abs(r), 1e-30)  # noqa: E731
        row = {"shape": name, "case": case, "rows": int(packed["tokens"].shape[0]), "pack_len": pack_len,
               "sequences": n, "response_tokens": int(packed["loss_mask"].sum()),
               "segments_per_row_max": int(packed["segment_ids"].max()),
               "loss_jaxrl": m["loss"], "loss_torch": t["loss"], "loss_abs_diff": abs(m["loss"] - t["loss"]),
               "loss_scale": t["loss_scale"], "loss_rel": abs(m["loss"] - t["loss"]) / t["loss_scale"],
               "metrics_jaxrl": {k: m[k] for k in ("kl", "entropy", "nll", "clip_frac", "grad_norm", "tokens")},
               "metrics_torch": {k: t[k] for k in ("kl", "entropy", "nll", "clip_frac", "grad_norm", "tokens")},
               "metric_rel": {k: rel(m[k], t[k]) for k in ("kl", "entropy", "nll", "grad_norm")},
               "clip_frac_abs": abs(m["clip_frac"] - t["clip_frac"]),
               "logp_max_abs_diff": float(np.max(np.abs(start_logp - logp.numpy())[valid])),
               "skipped": int(m["skipped"]), "update": upd}
        row["failures"] = check(row) + (["jaxrl skipped the update"] if row["skipped"] else [])
        row["passed"] = not row["failures"]
        print(f"agreement {name} {case}: loss {m['loss']:.6g} vs {t['loss']:.6g} (rel {row['loss_rel']:.1e}), "
              f"logp {row['logp_max_abs_diff']:.1e}, update rel {upd['max_rel']:.1e} ({upd['worst']}), "
              f"l2 {upd['max_l2_rel']:.1e}, "
              f"clip_frac {m['clip_frac']:.3f} -> {'ok' if row['passed'] else row['failures']}", file=sys.stderr)
        cases.append(row)
    return cases


# --------------------------------------------------------------------------------------------------- timing

def causal_pairs(seq_len: int, block_q: int = ATTENTION_BLOCK_Q) -> int:
    """(query, key) score entries `attention_chunked` computes for one causal row of `seq_len` tokens
    (module docstring): query chunk [t0, t1) attends keys [0, t1); one chunk (the full square) when
    seq_len <= block_q. Closed form b² · n(n+1)/2 + r · S for S = n · b + r."""
    if seq_len <= block_q:
        return seq_len * seq_len
    n, r = divmod(seq_len, block_q)
    return block_q * block_q * n * (n + 1) // 2 + r * seq_len


def step_flops(cfg: ModelConfig, tokens: int, seq_len: int) -> dict:
    """FLOPs of one train step on `tokens` tokens in rows of `seq_len` (module docstring): dense layers, lm_head,
    causal attention as `attention_chunked` computes it."""
    if SPEC.attention_impl != "xla":
        raise ValueError(f"causal_pairs counts attention_chunked's work; the step runs {SPEC.attention_impl!r}")
    if tokens % seq_len:
        raise ValueError(f"{tokens} tokens do not fill rows of {seq_len}")
    h, d = cfg.hidden_size, cfg.head_dim
    rows, pairs = tokens // seq_len, causal_pairs(seq_len)
    layer = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.intermediate_size
    out = {"dense": 6 * cfg.num_layers * layer * tokens, "lm_head": 6 * h * cfg.vocab_size * tokens,
           "attention": 12 * cfg.num_layers * cfg.num_heads * d * rows * pairs}
    out["total"] = sum(out.values())
    out["params_nonembedding_matmul"] = cfg.num_layers * layer
    out["attention_pairs_per_row"] = pairs
    out["attention_block_q"] = ATTENTION_BLOCK_Q
    return out


def bench_row(name: str, cfg: ModelConfig, shape: BatchShape, args, peak: float | None, counter: CompileCounter):
    rng = np.random.default_rng(0)
    samples = grpo_samples(rng, cfg.vocab_size, shape.rows, shape.group, shape.prompt, [shape.response] * shape.rows)
    packed, where = packed_batch(samples, shape.seq_len, shape.response)
    assert packed["tokens"].shape == (shape.rows, shape.seq_len) and packed["segment_ids"].max() == 1
    params = init(jax.random.key(0), cfg, jnp.float32)
    batch = _device(packed)
    batch["ref_logp"] = make_logprob_fn(cfg, SPEC)(perturbed(params, jax.random.key(1), REF_NOISE), batch)
    tx, _ = make_optimizer(OPTIM, 1)
    state = [params, tx.init(params)]
    exe, remat, temp, compile_s = compile_step(cfg, tx, *state, batch, args.mem_budget_gib * 2**30)
    step_t = TorchStep(torch_model(cfg, params), SPEC, OPTIM)          # before the first step donates params
    tb = torch_batch({k: np.asarray(v) for k, v in batch.items()}, where)

    def run_jax():
        state[0], state[1], m = exe(state[0], state[1], batch, 1.0)
        jax.block_until_ready((state[0], m))

    def run_torch():
        step_t(tb)

    for _ in range(args.warmup):
        run_jax()
        run_torch()
    counter.take()
    times = interleaved({"jaxrl": run_jax, "torch": run_torch}, args.repeats).seconds   # the same machine state
    jt, tt = times["jaxrl"], times["torch"]
    compiles = counter.take()["compiles"]
    tokens = shape.rows * shape.seq_len
    flops = step_flops(cfg, tokens, shape.seq_len)
    j, t = min(jt), min(tt)
    row = {"shape": name, "batch": shape.name, "tokens": tokens, "rows": shape.rows, "seq_len": shape.seq_len,
           "prompt_tokens": shape.prompt, "response_tokens": shape.response, "remat": remat,
           "jaxrl_s": j, "torch_s": t, "ratio": t / j,
           "jaxrl_median_s": statistics.median(jt), "torch_median_s": statistics.median(tt),
           "ratio_median": statistics.median(tt) / statistics.median(jt),
           "gflop_per_step": flops["total"] / 1e9, "flops": flops,
           "jaxrl_gflops": flops["total"] / j / 1e9, "torch_gflops": flops["total"] / t / 1e9,
           "peak_fraction": flops["total"] / j / 1e9 / peak if peak else None,
           "jaxrl_temp_gib": temp / 2**30, "jaxrl_compile_s": compile_s, "compiles_during_timing": compiles,
           "jaxrl_times_s": jt, "torch_times_s": tt}
    print(f"{name} {shape.name}: jaxrl {j:.3f}s torch {t:.3f}s ratio {t / j:.2f} "
          f"({row['jaxrl_gflops']:.1f} vs {row['torch_gflops']:.1f} GFLOP/s, remat {remat}, "
          f"{compiles} compiles)", file=sys.stderr, flush=True)
    return row


# ----------------------------------------------------------------------------------------------------- main

def _load_peak() -> tuple[float | None, str]:
    spec = importlib.util.spec_from_file_location("bench_peak", HERE / "bench_peak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got = mod.load_peak()
    return (got or {}).get("peak_gflops", {}).get("float32"), str(mod.DEFAULT_OUT)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "backend": jax.default_backend(), "device_used": str(jax.devices()[0]),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _max_rss_gib() -> float | None:
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20        # KiB on Linux
    except (ImportError, OSError):
        return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file to write (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="tiny model and batch, one repeat (a smoke test)")
    ap.add_argument("--repeats", type=int, default=None, help="timed interleaved repeats (default 5; --quick 1)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each side after compiling (default 1)")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"model shapes (default: {' '.join(MODELS)})")
    ap.add_argument("--batches", nargs="+", default=None,
                    help=f"batch shapes (default: {' '.join(b.name for b in BATCHES)})")
    ap.add_argument("--agreement-only", action="store_true", help="check agreement, time nothing")
    ap.add_argument("--mem-budget-gib", type=float, default=12.0,
                    help="jaxrl step temp memory above which remat layer is used (default %(default)s)")
    args = ap.parse_args(argv)
    models, batches = (QUICK_MODELS, QUICK_BATCHES) if args.quick else (MODELS, BATCHES)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    for flag, chosen, known in (("--shapes", args.shapes, list(models)), ("--batches", args.batches,
                                                                         [b.name for b in batches])):
        if chosen and set(chosen) - set(known):
            ap.error(f"{flag}: unknown {sorted(set(chosen) - set(known))}; valid choices: {', '.join(known)}")
    args.models = {k: v for k, v in models.items() if not args.shapes or k in args.shapes}
    args.batch_shapes = [b for b in batches if not args.batches or b.name in args.batches]
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    import torch

    args = parse_args(argv)
    cpu_compile_level()             # the LLVM level a user's CPU process compiles at (no-op once JAX has started)
    torch.set_num_threads(2)
    t_start, load_before = time.perf_counter(), _loadavg()
    peak, peak_path = _load_peak()
    result = {
        "machine": _machine(),
        "settings": {"quick": args.quick, "repeats": args.repeats, "warmup": args.warmup,
                     "mem_budget_gib": args.mem_budget_gib, "aggregation": AGG,
                     "loss": dataclasses.asdict(SPEC), "optimizer": dataclasses.asdict(OPTIM) | {
                         "kind": "AdamW (decay on matrices) + clip_by_global_norm; "
                                 "torch.optim.AdamW + clip_grad_norm_"},
                     "reference_noise": REF_NOISE, "off_policy_noise": OLD_NOISE,
                     "models": {k: dataclasses.asdict(v) for k, v in args.models.items()},
                     "batches": [dataclasses.asdict(b) for b in args.batch_shapes],
                     "timing": "interleaved jaxrl/torch repeats after untimed warm-up; "
                               "*_s = best, *_median_s = median"},
        "flops_formula": FLOPS_FORMULA,
        "peak_gflops_float32": peak, "peak_source": peak_path,
        "loadavg_before": load_before,
    }
    cases = [c for name, cfg in args.models.items() for c in agreement(name, cfg, args.quick)]
    passed = all(c["passed"] for c in cases)
    result["agreement"] = {"passed": passed, "tolerances": TOLERANCES, "cases": cases}
    rows = []
    if passed and not args.agreement_only:
        counter = CompileCounter()
        rows = [bench_row(name, cfg, b, args, peak, counter) for name, cfg in args.models.items()
                for b in args.batch_shapes]
    result.update(rows=rows, compiles_during_timing=sum(r["compiles_during_timing"] for r in rows),
                  loadavg_after=_loadavg(), max_rss_gib=_max_rss_gib(), wall_seconds=time.perf_counter() - t_start)
    result["note"] = (
        "torch runs unpacked: one sequence per row, right-padded, positions 0..L-1, no attention mask (causal "
        "attention never reaches the padding after a sequence), every input cut out of jaxrl's packed batch; the "
        "agreement batch packs ragged sequences several to a row on the jaxrl side, the timed batches hold one "
        "sequence per row so both sides do the same work. Reference log-probs are inputs of both steps (computed "
        "before, untimed). torch computes full [T, vocab] logits; jaxrl uses the chunked log-prob kernel, whose "
        "backward recomputes the lm_head tiles (not counted in the FLOPs); attention FLOPs are the causal score "
        "entries attention_chunked computes (flops_formula), not the full square. `remat` says which trainer.remat "
        "policy the jaxrl step ran with (the trainer's default; 'layer' only above --mem-budget-gib). CPU figures: "
        "only the side-by-side ratio means much; see loadavg_* for how busy the machine was."
        + ("" if passed else " AGREEMENT FAILED: nothing was timed."))
    write_result(args.out, result, indent=2)
    if not passed:
        bad = [f"{c['shape']} {c['case']}: {'; '.join(c['failures'])}" for c in cases if not c["passed"]]
        raise SystemExit(f"jaxrl and torch steps disagree, not timing ({args.out}): " + " | ".join(bad))
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = ["| shape | batch | jaxrl s | torch s | ratio | jaxrl GFLOP/s | torch GFLOP/s | peak fraction |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        frac = f"{r['peak_fraction']:.2f}" if r["peak_fraction"] is not None else "-"
        lines.append(f"| {r['shape']} | {r['batch']} | {r['jaxrl_s']:.3f} | {r['torch_s']:.3f} | {r['ratio']:.2f} | "
                     f"{r['jaxrl_gflops']:.1f} | {r['torch_gflops']:.1f} | {frac} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
