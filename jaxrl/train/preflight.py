"""Start-up checks of `python -m jaxrl.train` that need no devices: environment, paths, tokenizer, resume.

The config validates its own values; what it cannot see — whether the model directory and the data
file exist, which tokenizer goes with the model, whether the run directory already holds a run
trained with another config — is checked here, before JAX starts and before the run directory is
created. Every failure is a `StartupError` with one line naming the culprit (absolute paths), which
the entry point prints like a config error (exit 2).

**Tokenizer.** `data.tokenizer: null` (the default) means the model's own: `model.hf_path`'s
tokenizer files when a checkpoint directory is given, else the built-in character tokenizer of the
presets. An explicit tokenizer that does not match the model's (another vocabulary size, other ids
for the same text, other end-of-sequence ids) is an error: a model trained on ids it was not
pretrained with learns nothing useful, and nothing else would say so.

**Resume.** A run directory with a committed checkpoint is a run to resume. Its config (the newest of
`config.yaml` and the `config.step<N>.yaml` files written by later resumes) is compared with the new
one: equal, or different only in `RUN_LENGTH_KEYS` and `LAYOUT_KEYS` → resume; different in anything else →
stop and name the keys, unless `--resume=force`. The layout is where a run runs, not what it computes: a run
resumes on another process count (the `distributed` keys, a launcher's) or mesh, its arrays restored into the
new shardings (`checkpoint`), its results then those of a run on the new layout (docs/cluster.md). Only a
train `tp` that pads the vocabulary rows to another count (`sharding.padded_vocab_for`) changes the arrays'
shapes, and stops here. The saved `config.yaml` is never rewritten by a resume: a
resume whose config differs writes `config.step<N>.yaml` beside it (N = the step it resumes at).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from jaxrl import executable_store
from jaxrl.config import from_yaml, to_yaml
from jaxrl.config.base import ConfigError
from jaxrl.config.train import TrainConfig
from models import load_tokenizer, padded_vocab

from .distributed import launch

# Keys that may change between a run and its resume: how long it runs, how often it saves, what it
# records, where the processes meet. Everything else changes the training itself.
RUN_LENGTH_KEYS = ("steps", "time_budget_min", "save_every", "keep_checkpoints", "profile_steps", "export_hf", "curves", "run_dir",
                   "distributed", "rewards.num_workers", "log_completions",
                   # what a run evaluates and when (eval.split is not here: it takes rows out of training)
                   *(f"eval.{k}" for k in ("data", "every", "at_start", "at_end", "samples", "temperature", "pass_k",
                                           "pass_threshold", "max_prompts", "log_completions", "seed")))
# Keys that say where a run runs, not what it computes: the train mesh and the rollout instances (their count
# per process changes with the process count). A resume on others equals a run on them from the start: bit
# for bit where the math does not depend on the layout (the data, the rollouts' tokens), within float rounding
# where it does (sums split another way).
LAYOUT_KEYS = ("train_layout", "engine.instances", "engine.tp")
RESUME_MODES = ("auto", "force")
_PROBE = "Hello, world! 0123456789 The quick brown fox: (a+b)=c?\n"
_STEP_CONFIG = re.compile(r"^config\.step(\d+)\.yaml$")


class StartupError(Exception):
    """A one-line start-up problem outside the config's own validation."""


@contextlib.contextmanager
def startup_errors(*pools, prefix: str = "", convert: bool = True):
    """A `ValueError` while the trainer builds (a bad data file, reward, environment, graph) becomes a
    `StartupError` with `prefix` (the config key): one line, not a traceback; `pools` (reward pools) are closed,
    also when a `StartupError` passes (`convert=False`: only then)."""
    try:
        yield
    except (ValueError, StartupError) as e:
        for pool in pools:
            pool.close()
        if isinstance(e, StartupError) or not convert:
            raise
        raise StartupError(prefix + str(e)) from None


def absolute(path: str | os.PathLike) -> str:
    return str(Path(path).expanduser().resolve())


# -------------------------------------------------------------------------------------------- paths
def check_paths(cfg: TrainConfig) -> None:
    """The model checkpoint directory, the data file and the skew placement's files exist."""
    if cfg.model.hf_path is not None:
        d = Path(cfg.model.hf_path)
        if not d.is_dir():
            raise StartupError(f"model.hf_path={absolute(d)}: no such directory (to fetch SmolLM2-135M-Instruct "
                               f"there: python -m models.fetch smollm2-135m-instruct {d})")
        if not (d / "config.json").is_file():
            raise StartupError(f"model.hf_path={absolute(d)}: no config.json there (not a Hugging Face checkpoint "
                               "directory)")
    if cfg.data.source != "builtin":
        p = Path(cfg.data.source)
        if not p.is_file():
            raise StartupError(f"data.source={absolute(p)}: no such file (a .jsonl or .parquet file, or 'builtin')")
    sk = cfg.rollout.skew
    for key, path in (("rollout.skew.ranker.pairs", sk.ranker.pairs if sk.enabled else None),
                      ("rollout.skew.profile", sk.profile if sk.enabled else None)):
        if path is not None and not Path(path).is_file():
            raise StartupError(f"{key}={absolute(path)}: no such file")
    if cfg.data.tokenizer not in (None, "char", "model") and not Path(cfg.data.tokenizer).is_dir():
        raise StartupError(f"data.tokenizer={absolute(cfg.data.tokenizer)}: no such directory "
                           "(a directory with tokenizer.json, 'char', or null for the model's own)")


# ---------------------------------------------------------------------------------------- tokenizer
def _has_tokenizer(directory: str | os.PathLike) -> bool:
    return (Path(directory) / "tokenizer.json").is_file()


def same_tokenizer(a, b) -> bool:
    text = a.apply_chat_template([{"role": "user", "content": _PROBE}])
    return (a.vocab_size == b.vocab_size and a.encode(_PROBE) == b.encode(_PROBE)
            and tuple(a.eos_ids) == tuple(b.eos_ids) and a.encode(text) == b.encode(text))


def tokenizer_source(cfg: TrainConfig) -> str:
    """What `models.load_tokenizer` loads for this run: "char" or a directory (see the module docstring)."""
    given, model_dir = cfg.data.tokenizer, cfg.model.hf_path
    if given in (None, "model"):
        if model_dir is None:
            if given == "model":
                raise StartupError("data.tokenizer=model needs model.hf_path (a checkpoint directory with "
                                   "tokenizer.json)")
            return "char"
        if not _has_tokenizer(model_dir):
            raise StartupError(f"model.hf_path={absolute(model_dir)} has no tokenizer.json; set data.tokenizer to a "
                               "directory that has one (or 'char')")
        return model_dir
    if model_dir is not None and _has_tokenizer(model_dir) and absolute(given) != absolute(model_dir):
        ours, theirs = load_tokenizer(given), load_tokenizer(model_dir)
        if not same_tokenizer(ours, theirs):
            name = given if given == "char" else absolute(given)
            raise StartupError(f"data.tokenizer={name} ({ours.vocab_size} tokens) does not match the tokenizer of "
                               f"model.hf_path={absolute(model_dir)} ({theirs.vocab_size} tokens); leave "
                               "data.tokenizer unset to use the model's own")
    return given


def check_tokenizer(cfg: TrainConfig) -> str:
    """`tokenizer_source`, and its vocabulary fits the model's embedding table."""
    source = tokenizer_source(cfg)
    tok = load_tokenizer(source)
    try:
        model_vocab = cfg.model.model_config().vocab_size
    except (ValueError, KeyError, OSError) as e:
        where = f"model.hf_path={absolute(cfg.model.hf_path)}: " if cfg.model.hf_path else ""
        raise StartupError(f"{where}{str(e).splitlines()[0]}") from None
    if tok.vocab_size > model_vocab:
        name = source if source == "char" else absolute(source)
        raise StartupError(f"tokenizer {name} has {tok.vocab_size} tokens, more than the model's vocab_size "
                           f"{model_vocab}")
    return source


# ------------------------------------------------------------------------------------------- resume
def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(old: TrainConfig, new: TrainConfig, ignore=RUN_LENGTH_KEYS) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every field that differs outside `ignore` (keys or sections)."""
    a, b = _flatten(old), _flatten(new)
    skip = lambda k: any(k == i or k.startswith(i + ".") for i in ignore)  # noqa: E731
    keys = list(b) + [k for k in a if k not in b]
    return [(k, a.get(k), b.get(k)) for k in keys if not skip(k) and a.get(k) != b.get(k)]


def committed_checkpoints(run_dir: Path) -> list[int]:
    """Steps with a COMMITTED marker (`jaxrl.train.checkpoint`); not verified here (restore does that)."""
    d = run_dir / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / "COMMITTED").is_file())


def saved_config_path(run_dir: Path) -> Path | None:
    """The config the run directory was last trained with: the newest `config.step<N>.yaml`, else config.yaml."""
    steps = [(int(m.group(1)), p) for p in run_dir.glob("config.step*.yaml") if (m := _STEP_CONFIG.match(p.name))]
    if steps:
        return max(steps)[1]
    p = run_dir / "config.yaml"
    return p if p.is_file() else None


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """`resume`: a committed checkpoint exists; `write_config`: the file the new config goes to (None = none);
    `changed`: keys that differ from the saved config (run-length keys included)."""

    resume: bool
    write_config: str | None
    changed: tuple[str, ...] = ()

    @property
    def relayout(self) -> tuple[str, ...]:
        """The layout keys (`LAYOUT_KEYS`) this resume changes."""
        return tuple(k for k in self.changed if any(k == i or k.startswith(i + ".") for i in LAYOUT_KEYS))


def plan_resume(cfg: TrainConfig, mode: str = "auto") -> ResumePlan:
    """Decide fresh start or resume of `cfg.run_dir` (see the module docstring); StartupError on a mismatch."""
    if mode not in RESUME_MODES:
        raise StartupError(f"--resume={mode}: expected one of {', '.join(RESUME_MODES)}")
    run_dir = Path(cfg.run_dir)
    steps = committed_checkpoints(run_dir)
    if not steps:
        return ResumePlan(False, "config.yaml")
    saved_path = saved_config_path(run_dir)
    if saved_path is None:
        if mode != "force":
            raise StartupError(f"{absolute(run_dir)} holds checkpoints but no config.yaml to compare with; continue "
                               "with --resume=force or start a new run with --run-dir DIR")
        return ResumePlan(True, f"config.step{steps[-1]}.yaml")
    try:
        saved = from_yaml(TrainConfig, saved_path.read_text())
    except (ConfigError, OSError) as e:
        if mode != "force":
            raise StartupError(f"{absolute(saved_path)}: cannot read the saved config ({e}); continue with "
                               "--resume=force or start a new run with --run-dir DIR") from None
        return ResumePlan(True, f"config.step{steps[-1]}.yaml")
    differ = config_diff(saved, cfg, ignore=RUN_LENGTH_KEYS + LAYOUT_KEYS)
    check_vocab_rows(saved, cfg)
    if differ and mode != "force":
        shown = ", ".join(f"{k} ({_short(a)} -> {_short(b)})" for k, a, b in differ[:6])
        more = f" and {len(differ) - 6} more" if len(differ) > 6 else ""
        raise StartupError(f"{absolute(run_dir)} holds a run (checkpoint at step {steps[-1]}) trained with another "
                           f"config: {shown}{more}. Resume it without those changes, start a new run with --run-dir "
                           "DIR, or continue it with the new values with --resume=force")
    changed = tuple(k for k, _, _ in config_diff(saved, cfg, ignore=("run_dir",)))
    return ResumePlan(True, f"config.step{steps[-1]}.yaml" if changed else None, changed)


def check_vocab_rows(saved: TrainConfig, cfg: TrainConfig) -> None:
    """A resume on another train `tp` keeps the embedding's shape: its vocabulary rows are padded to a multiple
    of tp, and a tp that pads to another count would need rows added or cut (not done: StartupError)."""
    if saved.train_layout.tp == cfg.train_layout.tp:
        return
    vocab = cfg.model.model_config().vocab_size
    before, after = padded_vocab(vocab, saved.train_layout.tp), padded_vocab(vocab, cfg.train_layout.tp)
    if before != after:
        raise StartupError(f"train_layout.tp={cfg.train_layout.tp}: the checkpoint's {vocab}-token vocabulary is "
                           f"padded to {before} rows (tp {saved.train_layout.tp}), this tp pads it to {after}; "
                           f"resume on a tp that divides {before}")


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, str) else v
    return text if len(text) <= 40 else text[:37] + "..."


def write_config(cfg: TrainConfig, plan: ResumePlan) -> None:
    """Write the run's config where `plan` says (main process only; never over another run's config.yaml)."""
    if plan.write_config is None:
        return
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / plan.write_config).write_text(to_yaml(cfg))


def check_environment(cfg: TrainConfig | None = None) -> None:
    """The environment variables read only at the first compilation (`jaxrl.executable_store`'s bound), and the
    launcher's (`distributed.launch`: a half-configured mpirun, srun or Kubernetes environment)."""
    try:
        executable_store.max_bytes_from_env()
        if cfg is not None:
            launch(cfg.distributed)
    except ValueError as e:
        raise StartupError(str(e)) from None


def preflight(cfg: TrainConfig, resume: str = "auto") -> ResumePlan:
    """Every check above, in order; returns the resume plan. Creates nothing."""
    check_environment(cfg)
    check_paths(cfg)
    check_tokenizer(cfg)
    return plan_resume(cfg, resume)


def discard_unstarted(run_dir: Path, plan: ResumePlan) -> None:
    """A run that failed before its first RL step: remove its checkpoint 0 and the config.yaml it wrote,
    so the next run in this directory starts clean (with whatever config it has). Process 0 only."""
    shutil.rmtree(run_dir / "checkpoints" / "0", ignore_errors=True)
    try:
        (run_dir / "checkpoints").rmdir()      # only when nothing else (e.g. *.corrupt) is there
    except OSError:
        pass
    if plan.write_config == "config.yaml":
        (run_dir / "config.yaml").unlink(missing_ok=True)
    print(f"[train] the run failed before its first RL step; removed its checkpoint 0 and config.yaml from "
          f"{run_dir.resolve()}, so the next run there starts fresh", file=sys.stderr, flush=True)
