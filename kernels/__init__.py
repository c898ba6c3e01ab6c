"""Attention kernels (Pallas with pure-jnp references) and the chunked vocabulary projection."""

from .attention import attention, attention_reference

__all__ = ["attention", "attention_reference"]
