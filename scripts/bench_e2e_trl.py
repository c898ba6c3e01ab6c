"""The TRL side of the end-to-end GRPO benchmark: one process = one `trl.GRPOTrainer` run, timed per optimizer step.

    python scripts/bench_e2e_trl.py --model DIR --prompts FILE.jsonl --reward PATH/module.py:fn --out OUT.json \
        --steps 7 --prompts-per-step 4 --group 8 --max-new 512 --lr 1e-6 --temperature 1.0 --seed 0 \
        --clip-low 0.2 --clip-high 0.28 --threads 2

CPU, float32, generation by `transformers.generate` (no vLLM). How the settings map to jaxrl's:
  prompts-per-step x group  -> per_device_train_batch_size = prompts*group, num_generations = group,
                               gradient_accumulation_steps = steps_per_generation = num_iterations = 1
                               (one generation batch per optimizer step, on-policy: TRL skips the old-logp pass)
  max-new / temperature     -> max_completion_length / temperature; top_p 1.0, top_k 0 (off), repetition_penalty 1.0
  clip-low / clip-high      -> epsilon / epsilon_high;  beta 0.0 (no reference model)
  token-mean loss           -> loss_type "dapo" (sum over the batch's completion tokens / their count)
  advantages                -> scale_rewards "group": (r - group mean) / (group std + 1e-4); TRL's std is unbiased
  optimizer                 -> adamw_torch, lr constant, no warmup, weight_decay 0, max_grad_norm 1, eps 1e-8
Prompts are plain text used as-is (TRL's non-conversational "prompt" column: no chat template); with `--chat`
each is one user message (TRL's conversational column: the tokenizer's chat template with the generation
prompt, as jaxrl's data.chat=true), and the reward reads the assistant message's text.

Timing: TRL generates inside `training_step -> _prepare_inputs -> _generate_and_score_completions -> _generate ->
_generate_single_turn` (the `model.generate` call), i.e. between the Trainer's `on_step_begin` and `on_step_end`
callbacks, which also bracket the loss forward/backward, grad clipping and `optimizer.step`. So step_s =
on_step_begin -> on_step_end, generate_s = time in `_generate_single_turn` (tokenized prompts -> completion ids,
truncated after the first EOS), train_s = step_s - generate_s (rewards, advantages, loss, backward, update).
"""

from __future__ import annotations

import time

T0 = time.time()  # as early as possible: before any import beyond `time`

import os  # noqa: E402

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
               "WANDB_DISABLED": "true", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
               "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true"}.items():
    os.environ[_k] = _v

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

T_IMPORT = time.time()


def process_start_time() -> float | None:
    """The process's real start (epoch seconds, ~10 ms resolution) from /proc, or None off Linux."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 (starttime), counted after "pid (comm)"
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def load_reward(spec: str) -> Callable[[str, str, str], float]:
    """`path/to/module.py:fn` -> fn(response, answer, task) -> float."""
    path, _, name = spec.rpartition(":")
    mod_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return getattr(module, name)


class Recorder(TrainerCallback):
    """Per optimizer step: wall time, generation time/tokens (fed by the trainer), rewards, TRL's logs."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.first_step_begin: float | None = None
        self.generate_calls = 0
        self.train_summary: dict[str, float] = {}
        self._reset()

    def _reset(self) -> None:
        self.gen_s, self.lengths, self.rewards, self.begin = 0.0, [], [], time.time()

    def on_step_begin(self, args, state, control, **kwargs):
        self._reset()
        self.first_step_begin = self.first_step_begin or self.begin

    def on_step_end(self, args, state, control, **kwargs):
        step_s = time.time() - self.begin
        n = max(len(self.lengths), 1)
        rec = {"step": state.global_step, "step_s": step_s, "generate_s": self.gen_s, "train_s": step_s - self.gen_s,
               "completions": len(self.lengths), "completion_tokens": sum(self.lengths),
               "completion_len_mean": sum(self.lengths) / n, "completion_len_max": max(self.lengths, default=0),
               "reward_mean": sum(self.rewards) / max(len(self.rewards), 1)}
        self.steps.append(rec)
        print(f"step {rec['step']}: step {step_s:.2f}s  generate {self.gen_s:.2f}s  train {rec['train_s']:.2f}s  "
              f"{rec['completions']} completions, {rec['completion_tokens']} tokens, reward {rec['reward_mean']:.3f}",
              flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        if "train_runtime" in logs:
            self.train_summary = logs
        elif self.steps and self.steps[-1]["step"] == state.global_step:
            self.steps[-1]["trl_log"] = logs


class TimedGRPOTrainer(trl.GRPOTrainer):
    """GRPOTrainer whose generation (`_generate_single_turn`, wrapping `model.generate`) is timed and counted."""

    recorder: Recorder

    def _generate_single_turn(self, *args, **kwargs):
        t = time.time()
        completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
        self.recorder.gen_s += time.time() - t
        self.recorder.generate_calls += 1
        self.recorder.lengths += [len(ids) for ids in completion_ids]  # up to and including the first EOS
        return completion_ids, logprobs


def grpo_settings(a: argparse.Namespace) -> dict[str, Any]:
    """Every GRPOConfig field this benchmark sets. TRL's defaults differ from transformers' on bf16 (True) and
    gradient_checkpointing (True; in transformers 5 a deprecated alias of activation_checkpointing)."""
    return dict(
        use_cpu=True, bf16=False, fp16=False, activation_checkpointing=False, seed=a.seed, data_seed=a.seed,
        # batch: one generation batch of prompts*group completions = one optimizer step, used once
        per_device_train_batch_size=a.prompts_per_step * a.group, num_generations=a.group,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, max_steps=a.steps,
        shuffle_dataset=True, remove_unused_columns=False, dataloader_num_workers=0,
        # generation (transformers.generate)
        max_completion_length=a.max_new, temperature=a.temperature, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0, use_vllm=False, use_transformers_continuous_batching=False,
        # loss
        beta=0.0, loss_type="dapo", epsilon=a.clip_low, epsilon_high=a.clip_high, scale_rewards="group",
        mask_truncated_completions=False, disable_dropout=True,
        # optimizer
        optim="adamw_torch", learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, adam_epsilon=1e-8, adam_beta1=0.9, adam_beta2=0.999,
        # no saving, eval, reporting
        save_strategy="no", eval_strategy="no", report_to="none", logging_strategy="steps", logging_steps=1,
        log_completions=False, disable_tqdm=True, push_to_hub=False,
    )


def resolved_settings(trainer: trl.GRPOTrainer) -> dict[str, Any]:
    """What TRL actually ran with (to check the settings took): device, precision, batch split, generation config."""
    args, model = trainer.args, trainer.model
    return {"device": str(args.device), "bf16": args.bf16, "activation_checkpointing": args.activation_checkpointing,
            "model_activation_checkpointing": bool(getattr(model, "is_activation_checkpointing", False)),
            "dtype": str(model.dtype), "attn_implementation": model.config._attn_implementation,
            "generation_batch_size": args.generation_batch_size, "steps_per_generation": args.steps_per_generation,
            "ref_model": trainer.ref_model is not None, "eos_token_ids": trainer.eos_token_ids,
            "pad_token_id": trainer._tokenizer.pad_token_id,
            "generation_config": trainer.generation_config.to_diff_dict()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--reward", required=True, help="path/to/module.py:fn, fn(response, answer, task) -> float")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chat", action="store_true", help="prompts as one user message each (the chat template)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    fn = load_reward(a.reward)
    recorder = Recorder()

    def reward(completions: list[str], answer: list[str], task: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]   # conversational: messages
        out = [float(fn(c, ans, t)) for c, ans, t in zip(texts, answer, task, strict=True)]
        recorder.rewards += out
        return out

    reward.__name__ = getattr(fn, "__name__", "reward")

    rows = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    prompt = (lambda p: [{"role": "user", "content": p}]) if a.chat else (lambda p: p)
    dataset = datasets.Dataset.from_list([{"prompt": prompt(r["prompt"]), "answer": r["answer"], "task": r["task"]}
                                          for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    settings = grpo_settings(a)
    with tempfile.TemporaryDirectory(prefix="bench_e2e_trl_") as out_dir:
        config = trl.GRPOConfig(output_dir=out_dir, **settings)
        trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                                   processing_class=tokenizer, callbacks=[recorder])
        trainer.recorder = recorder
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its dict-per-step print
        trainer.train()
        resolved = resolved_settings(trainer)
    t_end = time.time()

    proc_start = process_start_time()
    steps = recorder.steps
    result = {
        "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "settings": settings,
        "resolved": resolved, "generate_calls": recorder.generate_calls, "steps": steps,
        "trl_train_summary": recorder.train_summary,
        "import_s": T_IMPORT - T0, "setup_s": (recorder.first_step_begin or t_end) - T0, "process_s": t_end - T0,
        "proc_start_lag_s": None if proc_start is None else T0 - proc_start,
        "import_s_from_proc_start": None if proc_start is None else T_IMPORT - proc_start,
        "setup_s_from_proc_start": None if proc_start is None else (recorder.first_step_begin or t_end) - proc_start,
        "process_s_from_proc_start": None if proc_start is None else t_end - proc_start,
        "totals": {k: sum(s[k] for s in steps) for k in ("step_s", "generate_s", "train_s", "completion_tokens")},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"import {result['import_s']:.2f}s  setup {result['setup_s']:.2f}s  process {result['process_s']:.2f}s  "
          f"({recorder.generate_calls} generate calls, {len(steps)} steps) -> {a.out}", flush=True)


if __name__ == "__main__":
    main()
