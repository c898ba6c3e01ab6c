"""Attention kernels (Pallas, with pure-jnp references and an XLA runtime path) and the chunked
vocabulary projection.

    attention(q, k, v, *, q_offset, kv_lengths, causal, window, implementation="xla"|"pallas")
    paged_decode_attention(q, k_pages, v_pages, page_table, lengths) -> (o, l, m); merge_partials; normalize
"""

from .attention import BlockSizes, attention, attention_reference
from .logprobs import token_logprobs, token_logprobs_reference
from .paged_attention import merge_partials, normalize, paged_decode_attention, paged_decode_attention_reference

__all__ = ["BlockSizes", "attention", "attention_reference", "merge_partials", "normalize",
           "paged_decode_attention", "paged_decode_attention_reference", "token_logprobs",
           "token_logprobs_reference"]
