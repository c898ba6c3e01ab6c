"""The padded vocabulary a layout needs: `padded_vocab_for(cfg, layout)`.

Both roles shard the `vocab` axis (embedding rows, LM-head columns) on `tp` (`ShardingRules.train` and
`.rollout`), so a vocabulary that does not divide tp (GPT-2's 50257, Qwen2.5's tokenizer-sized 151665, a test
model's 311) is padded with zero rows up to the next multiple of tp, as Megatron and vLLM do, instead of being
replicated or rejected. The model side (`models.padded_vocab`, `fit_vocab`, the `vocab_size=` argument of
`weight_specs`/`init`/`load_hf`) keeps `cfg.vocab_size` the real vocabulary and ignores the padding.

    padded = padded_vocab_for(cfg, layout)
    shardings = shardings_for(models.logical_axes(cfg, vocab_size=padded), mesh, ShardingRules.train(cfg, layout))
    params = models.init(key, cfg, shardings=shardings, vocab_size=padded)

Heads, KV heads and the MLP width are not padded: a head count that does not divide tp stays an error
(`specs_for` names the leaf), since padding heads would change the model.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.weights import padded_vocab

from .layout import Layout


def padded_vocab_for(cfg: ModelConfig, layout: Layout) -> int:
    """`cfg.vocab_size` rounded up to a multiple of `layout.tp` (the mesh axis `vocab` is sharded on in
    both the train and rollout rules); equal to it when tp already divides."""
    return padded_vocab(cfg.vocab_size, layout.tp)
