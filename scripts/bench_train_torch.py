"""The torch side of `scripts/bench_train.py`: transformers' model holding jaxrl's weights, and jaxrl's RL loss and
update written in torch (see bench_train.py's docstring for what is compared and how).

Kept apart so bench_train.py stays one concept per file; not imported by the packages (ARCHITECTURE.md).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl.config.train import OptimSection
from jaxrl.train.step import LossSpec
from models import ModelConfig, config_to_hf
from models.hf import tensor_map


def unpack(packed: np.ndarray, where) -> np.ndarray:
    """[rows, pack_len] -> one sequence per row [n, max length], right-padded with zeros."""
    out = np.zeros((len(where), max(n for _, _, n in where)), packed.dtype)
    for i, (r, off, n) in enumerate(where):
        out[i, :n] = packed[r, off:off + n]
    return out


def hf_tensors(cfg: ModelConfig, weights) -> dict[str, np.ndarray]:
    """Our weights as HF tensors (`models.hf.tensor_map`, what `save_hf` writes), keyed by HF name; a
    per-layer name keeps its `{i}` and its tensors are stacked on axis 0."""
    out = {}
    for m, x in zip(jax.tree.leaves(tensor_map(cfg)), jax.tree.leaves(weights)):
        x = np.asarray(x, np.float32)
        out[m.name] = np.stack([m.to_hf(x[i]) for i in range(x.shape[0])]) if "{i}" in m.name else m.to_hf(x)
    return out


def torch_tensors(model, names) -> dict[str, np.ndarray]:
    """The torch model's tensors in `hf_tensors`' layout (the same `names`)."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    out = {}
    for n in names:
        if "{i}" not in n:
            out[n] = sd[n]
            continue
        layers = []
        while n.format(i=len(layers)) in sd:
            layers.append(sd[n.format(i=len(layers))])
        out[n] = np.stack(layers)
    return out


def torch_model(cfg: ModelConfig, weights):
    """transformers' model of `cfg` (float32, sdpa, train mode) holding exactly `weights`."""
    import torch
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(cfg, np.float32))
    hf_cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    state = {}
    for name, x in hf_tensors(cfg, weights).items():
        for i, part in (enumerate(x) if "{i}" in name else [(0, x)]):
            state[name.format(i=i)] = torch.from_numpy(np.array(part))      # a writable copy
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) - ({"lm_head.weight"} if cfg.tie_embeddings else set()) or unexpected:
        raise RuntimeError(f"weights do not map onto {type(model).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")
    if cfg.tie_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("transformers did not tie lm_head to the embedding")
    return model.train()


def torch_batch(packed: dict[str, np.ndarray], where) -> dict:
    """One sequence per row, right-padded, cut out of jaxrl's packed batch (same tokens, weights, log-probs).
    Positions run 0..L-1 over the whole row: padding follows each sequence, so causal attention never
    reaches it, and transformers sees no packing (its position-id packing detection stays off)."""
    import torch

    out = {k: torch.from_numpy(unpack(v, where)) for k, v in packed.items() if k not in ("positions", "segment_ids")}
    for k in ("tokens", "targets"):
        out[k] = out[k].long()
    out["loss_mask"] = out["loss_mask"].bool()
    n, L = out["tokens"].shape
    out["positions"] = torch.arange(L).expand(n, L).contiguous()
    return out


def torch_loss(model, b: dict, spec: LossSpec):
    """(Σ weights · ℓ over the mask, the step's metrics, logp): jaxrl.train.step.loss_fn in torch."""
    import torch

    z = model(input_ids=b["tokens"], position_ids=b["positions"], use_cache=False).logits
    if spec.temperature != 1.0:
        z = z / spec.temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = torch.gather(z, -1, b["targets"][..., None])[..., 0] - lse
    old = b["old_logp"] if "old_logp" in b else logp.detach()             # on-policy: ratio == 1
    ratio = torch.exp(logp - old)
    adv = b["advantages"]
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - spec.clip_low, 1.0 + spec.clip_high)
    tok = torch.maximum(unclipped, clipped)
    d = b["ref_logp"] - logp
    kl = torch.expm1(d) - d                                              # k3
    tok = tok + spec.kl_coef * kl
    mask = b["loss_mask"]
    terms = torch.where(mask, b["weights"] * tok, 0.0)
    loss = terms.sum()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        mean = lambda x: torch.where(mask, x, 0.0).sum() / n  # noqa: E731
        ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        stats = {"loss": loss.detach(), "loss_scale": terms.abs().sum(), "kl": mean(kl), "entropy": mean(ent),
                 "clip_frac": mean((clipped > unclipped).float()), "nll": mean(-logp), "tokens": n}
    return loss, stats, logp.detach()


class TorchStep:
    """forward + loss + backward + clip_grad_norm_ + AdamW (decay on the 2-D tensors, as jaxrl.train.optim)."""

    def __init__(self, model, spec: LossSpec, o: OptimSection):
        import torch

        self.model, self.spec, self.clip = model, spec, o.clip_norm
        params = list(model.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)

    def __call__(self, b: dict):
        import torch

        self.opt.zero_grad(set_to_none=True)
        loss, stats, logp = torch_loss(self.model, b, self.spec)
        loss.backward()
        stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return stats, logp
