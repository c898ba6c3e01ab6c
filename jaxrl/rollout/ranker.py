"""StreamRL's output-length ranker (§5.2): a small model that orders prompts by expected response length.

    ranker = LengthRanker(max_prompt_len=96)
    ranker.load_pairs("pairs.jsonl")              # optional warm start: {"tokens": [...], "length": n} rows
    ranker.observe(prompt_ids, response_lengths)  # after each rollout: (prompt tokens, observed length)
    stats = ranker.refresh()                      # continue training; {"kendall_tau", "recall_top20", ...}
    est = ranker.predict(prompt_ids)              # expected lengths in tokens (zeros until trained)
    state = ranker.state_dict()                   # JSON-able; ranker.load_state_dict(state) resumes exactly

The model reads a prompt's token ids hashed into `buckets` rows (`id % buckets`) plus learned positions,
runs `layers` pre-norm transformer encoder blocks under a padding mask, pools the tokens (masked mean,
masked sum / max_prompt_len — a count the model can scale — and log1p(prompt length)) and an MLP maps
that to one scalar, the predicted log1p(length). The loss is MSE on log1p(length) plus `rank_weight` x a
pairwise logistic ranking loss over the pairs inside a batch (RankNet: softplus(-(s_i - s_j)) for every
pair with l_i > l_j), since the scheduler only consumes the order.

`observe` keeps the newest `history` pairs (a ring buffer; prompts longer than max_prompt_len keep their
last max_prompt_len tokens). `refresh` splits the history by a hash of each pair's serial number (the
count of pairs observed before it), so a pair stays in the train or held-out part for as long as it
lives in the buffer, continues training the current parameters for `train_steps` Adam steps on minibatches
drawn from (seed, refresh number), then scores the held-out part. Every step runs at one shape
([batch, max_prompt_len]; predict pads to whole chunks of `batch` rows), so a ranker compiles its train
step and its forward once per process and never again.

Simplified versus the paper: StreamRL fine-tunes a small pretrained LM by SFT on (prompt, length) text and
reads the length it writes; we train a tiny transformer encoder from scratch with a regression head and a
ranking loss, which needs no checkpoint and trains in seconds on a CPU, but cannot bring a pretrained
model's sense of prompt difficulty. The paper's offline pre-pass over the whole dataset is the caller's
choice (`predict` on every prompt once); the skew-aware placement that consumes the order (§5.3) is not
in this module.
"""

from __future__ import annotations

import base64
import io
import json
import math
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

MIN_PAIRS = 8          # fewer pairs in the history: refresh trains nothing and reports nan metrics


# ----------------------------------------------------------------------------------------------- metrics

def kendall_tau(pred, true) -> float:
    """Kendall's tau-b between two score vectors: (C - D) / sqrt((n0 - n1)(n0 - n2)), n0 = n(n-1)/2 and
    n1, n2 the pairs tied in `pred`, `true`. O(n^2) in row chunks (~0.3 s for n = 5000); nan when n < 2
    or either side is constant."""
    x, y = np.asarray(pred, np.float64).ravel(), np.asarray(true, np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"kendall_tau: pred has {x.size} values, true has {y.size}")
    n = x.size
    if n < 2:
        return math.nan
    s = 0.0
    for a in range(0, n, 512):      # sum over ordered pairs counts each unordered pair twice
        s += float(np.sum(np.sign(x[a:a + 512, None] - x[None]) * np.sign(y[a:a + 512, None] - y[None])))
    n0 = n * (n - 1) / 2
    ties = [float(np.sum(c * (c - 1) / 2)) for c in (np.unique(v, return_counts=True)[1] for v in (x, y))]
    denom = math.sqrt((n0 - ties[0]) * (n0 - ties[1]))
    return s / 2 / denom if denom > 0 else math.nan


def recall_top(pred, true, frac: float = 0.2) -> float:
    """|predicted top-k ∩ true top-k| / k with k = ceil(frac · n): how many of the truly longest prompts
    the predictor flags. Ties (in `true` and in `pred`) rank the lower index first, so with many tied
    lengths at the cut even a perfect ranking may score below 1 against another tie order; nan when n = 0."""
    p, t = np.asarray(pred, np.float64).ravel(), np.asarray(true, np.float64).ravel()
    if p.shape != t.shape:
        raise ValueError(f"recall_top: pred has {p.size} values, true has {t.size}")
    if not 0 < frac <= 1:
        raise ValueError(f"recall_top: frac must be in (0, 1], got {frac}")
    if p.size == 0:
        return math.nan
    k = math.ceil(frac * p.size)
    top = [set(np.argsort(-v, kind="stable")[:k].tolist()) for v in (p, t)]
    return len(top[0] & top[1]) / k


# ------------------------------------------------------------------------------------------------- model

def init_params(key, *, buckets: int, max_len: int, d_model: int, layers: int) -> dict:
    """Plain-dict pytree; block weights stacked on a leading `layers` axis (scanned)."""
    d, ks = d_model, jax.random.split(key, 8)

    def dense(k, *shape):   # fan-in scaled normal
        return jax.random.normal(k, shape, jnp.float32) / math.sqrt(shape[-2])

    ones, zeros = jnp.ones((layers, d)), jnp.zeros((layers, d))
    return {"embed": 0.02 * jax.random.normal(ks[0], (buckets, d)),
            "pos": 0.02 * jax.random.normal(ks[1], (max_len, d)),
            "blocks": {"ln1": ones, "ln1_b": zeros, "qkv": dense(ks[2], layers, d, 3 * d),
                       "out": dense(ks[3], layers, d, d),
                       "ln2": ones, "ln2_b": zeros, "up": dense(ks[4], layers, d, 4 * d),
                       "up_b": jnp.zeros((layers, 4 * d)), "down": dense(ks[5], layers, 4 * d, d), "down_b": zeros},
            "ln_f": jnp.ones(d), "ln_f_b": jnp.zeros(d),
            "head_w": dense(ks[6], 2 * d + 1, d), "head_b": jnp.zeros(d), "out_w": dense(ks[7], d, 1)[:, 0] * 0.1,
            "out_b": jnp.zeros(())}


def _norm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def forward(params: dict, ids, mask, *, buckets: int, heads: int):
    """ids, mask [B, T] -> predicted log1p(length) [B]. Pad rows (mask all zero) give finite garbage."""
    B, T = ids.shape
    x = params["embed"][ids % buckets] + params["pos"][None, :T]
    d = x.shape[-1]
    bias = jnp.where(mask[:, None, None, :], 0.0, -1e9)    # keys only; queries at pads are pooled away

    def block(x, w):
        h = _norm(x, w["ln1"], w["ln1_b"])
        q, k, v = jnp.split((h @ w["qkv"]).reshape(B, T, 3 * heads, d // heads), 3, axis=2)
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads) + bias, axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, d) @ w["out"]
        h = _norm(x, w["ln2"], w["ln2_b"])
        return x + jax.nn.gelu(h @ w["up"] + w["up_b"]) @ w["down"] + w["down_b"], None

    x, _ = jax.lax.scan(block, x, params["blocks"])
    x = _norm(x, params["ln_f"], params["ln_f_b"])
    m = mask[..., None].astype(x.dtype)
    n = m.sum(1)
    feats = jnp.concatenate([(x * m).sum(1) / jnp.maximum(n, 1.0), (x * m).sum(1) / T, jnp.log1p(n)], axis=-1)
    return jax.nn.gelu(feats @ params["head_w"] + params["head_b"]) @ params["out_w"] + params["out_b"]


def loss_fn(params, ids, mask, y, *, buckets: int, heads: int, rank_weight: float):
    """MSE on y = log1p(length) + rank_weight · mean over pairs with y_i > y_j of softplus(-(s_i - s_j))."""
    s = forward(params, ids, mask, buckets=buckets, heads=heads)
    longer = (y[:, None] > y[None, :]).astype(s.dtype)
    rank = (jax.nn.softplus(s[None, :] - s[:, None]) * longer).sum() / jnp.maximum(longer.sum(), 1.0)
    return jnp.mean((s - y) ** 2) + rank_weight * rank


@partial(jax.jit, static_argnames=("buckets", "heads", "rank_weight", "lr"))
def _train_step(params, opt_state, ids, mask, y, *, buckets, heads, rank_weight, lr):
    loss, grads = jax.value_and_grad(loss_fn)(params, ids, mask, y, buckets=buckets, heads=heads,
                                              rank_weight=rank_weight)
    updates, opt_state = optax.adam(lr).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


_forward = jax.jit(forward, static_argnames=("buckets", "heads"))


def _split_hash(serial: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64(serial ^ seed-mix) mapped to [0, 1): a pair's fixed held-out lottery ticket."""
    z = serial.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15 * (seed + 1) % 2**64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _to_b64(tree) -> str:
    buf = io.BytesIO()
    np.savez(buf, *[np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree)])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _from_b64(text: str, like, what: str):
    leaves, treedef = jax.tree_util.tree_flatten(like)
    with np.load(io.BytesIO(base64.b64decode(text))) as f:
        got = [f[f"arr_{i}"] for i in range(len(f.files))]
    if len(got) != len(leaves) or any(g.shape != np.shape(x) for g, x in zip(got, leaves)):
        raise ValueError(f"state_dict {what}: {[g.shape for g in got]} does not match {[np.shape(x) for x in leaves]}")
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(g, np.asarray(x).dtype) for g, x in zip(got, leaves)])


# ------------------------------------------------------------------------------------------------ ranker

class LengthRanker:
    """Online (prompt tokens -> response length) ranker; see the module docstring."""

    def __init__(self, max_prompt_len: int, *, buckets: int = 1024, d_model: int = 64, layers: int = 2,
                 heads: int = 4, lr: float = 3e-3, train_steps: int = 300, batch: int = 64, history: int = 4096,
                 holdout: float = 0.2, rank_weight: float = 1.0, seed: int = 0):
        for name, v in (("max_prompt_len", max_prompt_len), ("buckets", buckets), ("d_model", d_model),
                        ("layers", layers), ("heads", heads), ("batch", batch), ("history", history)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"LengthRanker: {name} must be a positive int, got {v!r}")
        if d_model % heads:
            raise ValueError(f"LengthRanker: d_model={d_model} is not divisible by heads={heads}")
        if not isinstance(train_steps, (int, np.integer)) or train_steps < 0:
            raise ValueError(f"LengthRanker: train_steps must be an int >= 0, got {train_steps!r}")
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"LengthRanker: lr must be a positive finite float, got {lr!r}")
        if not 0 <= holdout < 1:
            raise ValueError(f"LengthRanker: holdout must be in [0, 1), got {holdout!r}")
        if not rank_weight >= 0:
            raise ValueError(f"LengthRanker: rank_weight must be >= 0, got {rank_weight!r}")
        self.config = {"max_prompt_len": int(max_prompt_len), "buckets": int(buckets), "d_model": int(d_model),
                       "layers": int(layers), "heads": int(heads), "lr": float(lr), "train_steps": int(train_steps),
                       "batch": int(batch), "history": int(history), "holdout": float(holdout),
                       "rank_weight": float(rank_weight), "seed": int(seed)}
        self.L, self.batch, self.history, self.seed = int(max_prompt_len), int(batch), int(history), int(seed)
        self._static = {"buckets": int(buckets), "heads": int(heads)}
        self._train_static = {**self._static, "rank_weight": float(rank_weight), "lr": float(lr)}
        self.params = init_params(jax.random.key(seed), buckets=buckets, max_len=self.L, d_model=d_model, layers=layers)
        self.opt_state = optax.adam(lr).init(self.params)
        self.trained, self.refreshes, self.steps, self.metrics = False, 0, 0, []
        self._tok = np.zeros((self.history, self.L), np.int32)     # ring buffer, slot = serial % history
        self._plen = np.zeros(self.history, np.int32)
        self._len = np.zeros(self.history, np.int64)
        self.count = 0                                               # pairs ever observed (next serial)

    # ------------------------------------------------------------------------------------------ history
    def observe(self, prompts: list[list[int]], lengths: list[int]) -> None:
        """Append (prompt tokens, observed response length) pairs; the oldest beyond `history` drop out."""
        if len(prompts) != len(lengths):
            raise ValueError(f"observe: {len(prompts)} prompts but {len(lengths)} lengths")
        rows = [self._row(p, i) for i, p in enumerate(prompts)]
        for i, n in enumerate(lengths):
            if int(n) != n or n < 0:
                raise ValueError(f"observe: length {i} is {n!r}; lengths must be ints >= 0")
        for (toks, n_tok), n in zip(rows, lengths):
            slot = self.count % self.history
            self._tok[slot], self._plen[slot], self._len[slot] = toks, n_tok, int(n)
            self.count += 1

    def _row(self, prompt, i: int = 0) -> tuple[np.ndarray, int]:
        toks = np.asarray(list(prompt), np.int64)[-self.L:]
        if toks.ndim != 1 or (toks.size and toks.min() < 0):
            raise ValueError(f"prompt {i} must be a list of token ids >= 0")
        out = np.zeros(self.L, np.int32)
        out[:toks.size] = toks
        return out, int(toks.size)

    def pairs(self) -> tuple[np.ndarray, list[list[int]], np.ndarray]:
        """(serials, prompt tokens, lengths) of the history, oldest first."""
        serials = np.arange(max(0, self.count - self.history), self.count)
        slots = serials % self.history
        return serials, [self._tok[s, :self._plen[s]].tolist() for s in slots], self._len[slots].copy()

    def heldout_mask(self, serials: np.ndarray) -> np.ndarray:
        """True where pair number `serial` belongs to the held-out part (fixed for the pair's lifetime)."""
        return _split_hash(np.asarray(serials), self.seed) < self.config["holdout"]

    # ------------------------------------------------------------------------------------ train, predict
    def warm(self) -> None:
        """Compile the train step and the forward (one shape each) now, on zeros (no state changes), so
        no later refresh or predict compiles."""
        z, m = np.zeros((self.batch, self.L), np.int32), np.zeros((self.batch, self.L), bool)
        jax.block_until_ready(_forward(self.params, z, m, **self._static))
        jax.block_until_ready(_train_step(self.params, self.opt_state, z, m, np.zeros(self.batch, np.float32),
                                          **self._train_static))

    def refresh(self) -> dict:
        """Continue training on the history's train part, then score its held-out part."""
        t0 = time.perf_counter()
        serials = np.arange(max(0, self.count - self.history), self.count)
        slots = serials % self.history
        held = self.heldout_mask(serials)
        train = slots[~held]
        losses = []
        if len(serials) >= MIN_PAIRS and train.size:
            y_all = np.log1p(self._len).astype(np.float32)
            if not self.trained:      # data-dependent output bias: Adam would take ~1/lr steps to get there
                self.params = {**self.params, "out_b": jnp.asarray(y_all[train].mean(), jnp.float32)}
            rng = np.random.default_rng([self.seed, self.refreshes])
            idx = train[rng.integers(0, train.size, size=(self.config["train_steps"], self.batch))]
            mask = np.arange(self.L)[None, :] < self._plen[:, None]
            for b in idx:
                self.params, self.opt_state, loss = _train_step(self.params, self.opt_state, self._tok[b], mask[b],
                                                                y_all[b], **self._train_static)
                losses.append(loss)
            self.steps += len(idx)
            self.refreshes += 1
            self.trained = True
        losses = np.asarray(jax.device_get(losses), np.float64)
        hs = slots[held]
        if self.trained and hs.size >= 2:
            pred = self._predict_rows(self._tok[hs], self._plen[hs])
            tau, rec = kendall_tau(pred, self._len[hs]), recall_top(pred, self._len[hs], 0.2)
        else:
            tau = rec = math.nan
        out = {"kendall_tau": tau, "recall_top20": rec, "pairs": int(serials.size), "heldout": int(hs.size),
               "train": int(train.size),
               "loss": float(losses[-max(1, losses.size // 4):].mean()) if losses.size else math.nan,
               "seconds": time.perf_counter() - t0, "refreshes": self.refreshes}
        self.metrics.append(out)
        return out

    def predict(self, prompts: list[list[int]]) -> np.ndarray:
        """Predicted response lengths in tokens (float64). Zeros, with `self.trained` False, before the
        first refresh that trained: an untrained model's order is noise, and zeros say "no information"
        (a stable sort then keeps the caller's order) rather than faking a prior."""
        rows = [self._row(p, i) for i, p in enumerate(prompts)]
        if not self.trained or not rows:
            return np.zeros(len(rows), np.float64)
        return self._predict_rows(np.stack([r[0] for r in rows]), np.asarray([r[1] for r in rows]))

    def _predict_rows(self, toks: np.ndarray, plen: np.ndarray) -> np.ndarray:
        n, B = len(toks), self.batch
        pad = -n % B
        toks = np.concatenate([toks, np.zeros((pad, self.L), np.int32)])
        mask = np.arange(self.L)[None, :] < np.concatenate([plen, np.zeros(pad, plen.dtype)])[:, None]
        outs = [_forward(self.params, toks[a:a + B], mask[a:a + B], **self._static) for a in range(0, n + pad, B)]
        return np.expm1(np.concatenate(jax.device_get(outs)).astype(np.float64)[:n]).clip(min=0.0)

    # -------------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict:
        """JSON-able state: config, params and Adam state (base64 `np.savez`), counters, history, metrics."""
        serials, toks, lens = self.pairs()
        return {"version": 1, "config": dict(self.config), "params": _to_b64(self.params),
                "opt_state": _to_b64(self.opt_state), "trained": self.trained, "refreshes": self.refreshes,
                "steps": self.steps, "count": self.count,
                "first_serial": int(serials[0]) if serials.size else self.count,
                "tokens": toks, "lengths": lens.tolist(),
                "metrics": [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in m.items()}
                            for m in self.metrics]}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output (from this process or through JSON). The config must match."""
        if state.get("version") != 1:
            raise ValueError(f"load_state_dict: unknown state version {state.get('version')!r}")
        for k, v in state["config"].items():
            if self.config.get(k) != v:
                raise ValueError(f"load_state_dict: state has {k}={v!r}, this ranker {k}={self.config.get(k)!r}")
        self.params = _from_b64(state["params"], self.params, "params")
        self.opt_state = _from_b64(state["opt_state"], self.opt_state, "opt_state")
        self.trained, self.refreshes, self.steps = bool(state["trained"]), int(state["refreshes"]), int(state["steps"])
        self.metrics = [{k: (math.nan if v is None else v) for k, v in m.items()} for m in state["metrics"]]
        self._tok[:], self._plen[:], self._len[:] = 0, 0, 0
        self.count = int(state["first_serial"])
        self.observe(state["tokens"], state["lengths"])
        if self.count != int(state["count"]):
            raise ValueError(f"load_state_dict: history ends at pair {self.count}, state says {state['count']}")

    def load_pairs(self, path) -> int:
        """Observe the pairs of a JSONL file of {"tokens": [int, ...], "length": int} rows (other keys
        ignored; blank lines skipped). Returns how many it read; a bad row raises naming file and line."""
        prompts, lengths = [], []
        with open(path) as f:
            for no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    toks, n = row["tokens"], row["length"]
                    if not (isinstance(toks, list) and all(isinstance(t, int) and t >= 0 for t in toks)):
                        raise ValueError('"tokens" must be a list of ints >= 0')
                    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                        raise ValueError(f'"length" must be an int >= 0, got {n!r}')
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{no}: bad pair row ({type(e).__name__}: {e})") from None
                prompts.append(toks)
                lengths.append(n)
        self.observe(prompts, lengths)
        return len(prompts)

    def save_pairs(self, path) -> int:
        """Write the history (oldest first, truncated prompts as stored) as `load_pairs` reads it."""
        _, toks, lens = self.pairs()
        Path(path).write_text("".join(json.dumps({"tokens": t, "length": int(n)}) + "\n" for t, n in zip(toks, lens)))
        return len(toks)
