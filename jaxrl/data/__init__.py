"""Data: prompt datasets (JSONL, Parquet, built-in tasks), the process-sharded resumable loader, and
the built-in task suite with verifiable rewards.

    from jaxrl.data import DataLoader, PromptDataset, encode_prompts
    ds = PromptDataset.builtin(["copy", "reverse", "repeat"], n=4096, seed=0)
    loader = DataLoader(ds, batch_size=16, process_index=jax.process_index(), process_count=jax.process_count())
    rows = next(loader); ids = encode_prompts(rows, tokenizer)
    reward = jaxrl.data.tasks.score(rows[0]["task"], response_text, rows[0]["answer"])

Nothing here imports JAX: reward workers import `jaxrl.data.tasks` cheaply.
"""

from .dataset import PromptDataset
from .loader import DataLoader, encode_demonstrations, encode_prompts, sft_batch
from .tasks import BUILTIN_TASKS, Example, Task, demonstration, long_tail_length, make_suite, prefix_score, score

__all__ = ["BUILTIN_TASKS", "DataLoader", "Example", "PromptDataset", "Task", "demonstration",
           "encode_demonstrations", "encode_prompts", "long_tail_length", "make_suite", "prefix_score",
           "score", "sft_batch"]
