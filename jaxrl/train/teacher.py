"""On-policy distillation's teacher (algo.advantage=opd; config `teacher`, `jaxrl.config.distill`): a frozen
model whose log-probs of the student's sampled tokens make the advantage (`jaxrl.flow.opd`).

    teacher = build(cfg.teacher, parts)            # registered: `jaxrl.train.components`
    logp = teacher.logprobs(mb, policy)            # [rows, L] on the train mesh's row sharding, per micro-batch

Two kinds:
* `teacher.hf_path` set: that checkpoint (any Llama/Qwen-family architecture; its tokenizer must equal the
  student's, checked at start-up in one line), loaded once and sharded on `teacher.layout`. Its log-prob pass is
  its own program, vocabulary-chunked (`kernels.logprobs`: no [tokens, vocab] logits).
  - placement=colocated: its own dp x fsdp x tp over the train devices (default the train layout); the packed
    micro-batch rows are laid out on the teacher's mesh inside its program and the log-probs come back on the
    train mesh's row sharding.
  - placement=pool: on `teacher.devices` devices of each process of its own (`Parts.reserved_devices`; default
    layout fsdp over all of them); each process's rows go to its own pool devices and the log-probs come back
    to its train rows through the host (token ids in, one float per token out).
* `teacher.hf_path` null: the run's reference policy (with LoRA the student's own base, else a copy of the
  weights RL starts from, checkpointed like the KL term's reference), scored by the update's own log-prob
  program; with algo.opd.student_logp=trainer the student's log-probs come from that same program, so a
  teacher equal to the student gives exactly 0.

Nothing of the teacher is checkpointed beyond the reference copy: its weights come back from `hf_path`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.config.distill import TeacherSection
from jaxrl.rollout.executor import abstract
from models import config_from_hf, load_tokenizer, logical_axes
from models.peft_io import load_weights
from sharding import Layout, ShardingRules, padded_vocab_for, shardings_for

from .batch import FIELDS
from .components import Parts, register
from .distributed import local_rows
from .preflight import StartupError, same_tokenizer
from .step import token_logp
from .update import CACHE

ROWS = P(("dp", "fsdp"), None)       # the packed rows' sharding on a mesh (the update's micro-batches)


def _teacher_logp(params, batch, *, cfg, temperature, attention_impl, rows):
    batch = {k: jax.lax.with_sharding_constraint(v, rows) for k, v in batch.items()}   # the teacher's layout
    return token_logp(params, cfg, batch, temperature, attention_impl=attention_impl)[0]


class Teacher:
    """`params` None: the policy's reference (scored by the update's log-prob program)."""

    def __init__(self, update, params=None, model_cfg=None, mesh=None, *, pool: bool = False, cache=CACHE):
        self.update, self.params, self.model_cfg, self.mesh, self.cache = update, params, model_cfg, mesh, cache
        self.pool, self.fn = pool, None
        if params is not None:
            spec, rows = update.spec, NamedSharding(mesh, ROWS)
            self.fn = jax.jit(functools.partial(_teacher_logp, cfg=model_cfg, temperature=spec.temperature,
                                                attention_impl=spec.attention_impl, rows=rows),
                              out_shardings=rows if pool else NamedSharding(update.mesh, ROWS))

    @property
    def is_reference(self) -> bool:
        return self.params is None

    def start(self, policy) -> None:
        """The reference teacher: the weights RL starts from, copied once (with LoRA the live base)."""
        if self.is_reference:
            policy.start_reference()

    def logprobs(self, mb: dict, policy) -> jax.Array:
        """The teacher's per-token log-probs [rows, L] of one packed micro-batch (its targets)."""
        fields = {k: mb[k] for k in FIELDS}
        if self.is_reference:
            return self.update.updater.logprobs(policy.ref_params, fields)
        if not self.pool:
            return self.cache("teacher_logp", self.fn, self.params, fields)
        train_rows = fields["tokens"].sharding
        moved = {k: self._on(NamedSharding(self.mesh, ROWS), local_rows(v, train_rows), v.shape)
                 for k, v in fields.items()}
        out = self.cache("teacher_logp", self.fn, self.params, moved)
        return self._on(train_rows, local_rows(out, NamedSharding(self.mesh, ROWS)), out.shape)

    @staticmethod
    def _on(sharding, local, shape):
        """This process's rows `local` as the global array `shape` on `sharding` (a pool's, or the train rows)."""
        return jax.make_array_from_process_local_data(sharding, local, shape)

    def warm(self, mb: dict, policy) -> int:
        """Compile the log-prob pass for the update's abstract micro-batch `mb` (the reference teacher's is the
        update's own, compiled by the update's warm-up with the reference weights)."""
        if self.is_reference:
            return 0
        before = self.cache.compiles
        fields = {k: mb[k] for k in FIELDS}
        if self.pool:
            rows = NamedSharding(self.mesh, ROWS)
            fields = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows) for k, v in fields.items()}
        self.cache.compile("teacher_logp", self.fn, abstract(self.params), fields)
        return self.cache.compiles - before


def check_vocabulary(hf_path: str, tokenizer_source: str) -> None:
    """The teacher's tokenizer is the student's (one line at start-up otherwise)."""
    where = f"teacher.hf_path={Path(hf_path).resolve()}"
    if not (Path(hf_path) / "tokenizer.json").is_file():
        raise StartupError(f"{where} has no tokenizer.json: the teacher's vocabulary must be the student's, and "
                           "without its tokenizer that cannot be checked")
    theirs, ours = load_tokenizer(hf_path), load_tokenizer(tokenizer_source)
    if not same_tokenizer(ours, theirs):
        raise StartupError(f"{where}: its tokenizer differs from the student's ({tokenizer_source}: "
                           f"{ours.vocab_size} tokens, the teacher's {theirs.vocab_size}); on-policy distillation "
                           "scores the student's token ids with the teacher, so both need one vocabulary")


@register("teacher", section="teacher", active=lambda cfg: cfg.algo.advantage == "opd")
def build(section: TeacherSection, parts: Parts) -> Teacher:
    uc = parts.update
    if section.hf_path is None:
        return Teacher(uc)
    check_vocabulary(section.hf_path, parts.tokenizer_source)
    try:
        model_cfg = config_from_hf(section.hf_path)
    except (ValueError, KeyError, OSError) as e:
        raise StartupError(f"teacher.hf_path={Path(section.hf_path).resolve()}: {str(e).splitlines()[0]}") from None
    pool = section.placement == "pool"
    if pool:
        devices = parts.reserved_devices
        layout = section.layout.build() if section.layout is not None else Layout(fsdp=len(devices))
        if layout.size != len(devices):
            raise StartupError(f"teacher.layout {layout.name} needs {layout.size} devices; the teacher's pool has "
                               f"{len(devices)} (teacher.devices={section.devices} on each of {jax.process_count()} "
                               "process(es))")
    else:
        devices, layout = parts.train_devices, (section.layout or uc.cfg.train_layout).build()
    if uc.mb_rows % (layout.dp * layout.fsdp):
        raise StartupError(f"teacher.layout {layout.name}: the update's micro-batches have {uc.mb_rows} rows, which "
                           f"do not split over its dp x fsdp = {layout.dp * layout.fsdp}; choose a layout whose dp x "
                           "fsdp divides them")
    mesh = uc.mesh if section.layout is None and not pool else layout.make_mesh(devices)
    vocab = padded_vocab_for(model_cfg, layout)
    shardings = shardings_for(logical_axes(model_cfg, vocab_size=vocab), mesh, ShardingRules.train(model_cfg, layout))
    params = load_weights(model_cfg, key=jax.random.key(parts.seed), dtype=parts.dtype, hf_path=section.hf_path,
                          shardings=shardings, vocab_size=vocab)
    if jax.process_index() == 0:
        where = f"its own pool of {len(devices)} devices" if pool else f"the {len(devices)} train devices"
        print(f"[train] teacher: {Path(section.hf_path).resolve()} ({model_cfg.num_layers} layers) on {where}, "
              f"layout {layout.name}", flush=True)
    return Teacher(uc, params, model_cfg, mesh, pool=pool)
