"""Multi-turn rollouts: each sample of a prompt is a trajectory of model turns and environment steps, one live
sequence in the engine from its first token to its last.

    mt = MultiTurn.from_config(cfg, tokenizer, pool)   # a run's (None when rollout.env is null)
    rnd = mt.round(svc, rows)                          # one rollout's: an environment reset on each row
    prompts = encode_prompts(rnd.rows, ...)            # the rows with each reset's opening text in the prompt
    rl.rollout_and_score(svc, ..., turns=rnd)          # drives the rest (below)

A turn ends at one of `rollout.turns.stops` (the sequence pauses in the engine holding its KV pages, no decode
slot) or at EOS / the token budget (the engine retires it). Either way the turn's text (its tokens since the last
observation) goes to the trajectory's environment step in a reward worker process (`jaxrl.envs.EnvRunner`: hard
timeout, crashes contained). The step's observation, rendered as the chat template renders a tool message
(`jaxrl.envs.render`), is appended to the paused sequence (`svc.add_tokens`: only it is prefilled) and
generation continues. A `done` step, the `max_turns`-th turn, a turn ended by EOS or the budget, or an
observation that would leave no room to generate (`truncated`) ends the trajectory (`svc.finish` returns its
completion). Its reward is the sum of its steps' rewards (GRPO's advantages are per trajectory).

Each sample of a prompt gets its own copy of the environment reset on the row (`copy.deepcopy`: the group's
samples start from the same state and the same opening text, so they share the prompt's KV pages). Resets run
in the trainer's process (once per row); steps in the workers.

Counters (`counters`, summed over all processes into `env/` metrics by the rollout side): trajectories, turns
(sum and max), tool calls, tool errors, format errors, tool seconds, environment errors (a step that raised, hung
or killed its worker), turn-limit and budget ends, observation tokens, and the positions continuation did not
prefill against re-prefilling the whole conversation every turn (`prefill_saved`: the prompt plus everything
before each observation).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

from jaxrl.config.train import TrainConfig
from jaxrl.envs import EnvLimits, EnvRunner
from jaxrl.envs.registry import env_factory, env_name, make_env
from jaxrl.envs.render import ObservationFormat
from jaxrl.rewards.registry import one_line, reward_fn_for, reward_name
from jaxrl.rollout import Completion, SamplingParams

from .distributed import global_max, global_sum


FAILED = {"timeout": "step_timeouts", "crash": "step_crashes"}     # a failed step's pool status -> its counter


@dataclasses.dataclass
class Trajectory:
    """One live trajectory of a round: its request, its environment (as of its last step), its latest completion
    and whether the engine ended it, the reward so far, its turns and its token budget after the prompt."""

    rid: int
    env: object
    budget: int
    last: Completion | None = None
    ended: bool = False
    reward: float = 0.0
    turns: int = 0


class MultiTurn:
    """A run's multi-turn side: the environment runner on the reward pool, the turn stops as token ids and
    the observation format. `round(svc, rows)` starts one rollout's trajectories."""

    def __init__(self, cfg: TrainConfig, tokenizer, pool, rows=()):
        """`rows`: the run's dataset; every environment its rows name must resolve (ValueError here, at start-up,
        not mid-step)."""
        t = cfg.rollout.turns
        self.default = cfg.rollout.env
        for name in sorted({env_name(row, self.default) for row in rows} | {self.default}):
            env_factory(name)
        self.tokenizer, self.cfg = tokenizer, cfg
        self.limits = EnvLimits(t.max_turns, t.step_timeout_s, t.max_observation_chars)
        self.runner = EnvRunner(pool, self.limits)
        self.format = ObservationFormat(tokenizer, cfg.data.chat)
        self.deterministic = t.deterministic
        multi = t.max_turns > 1                        # one turn: a plain request, stepped once at its end
        self.stops = tuple(tuple(tokenizer.encode(s)) for s in t.stops) if multi else ()
        self.turn_max_tokens = t.turn_max_tokens if multi else 0

    @classmethod
    def from_config(cls, cfg: TrainConfig, tokenizer, pool, rows=()) -> "MultiTurn | None":
        return cls(cfg, tokenizer, pool, rows) if getattr(cfg.rollout, "env", None) is not None else None

    def params(self, params: SamplingParams) -> SamplingParams:
        """A rollout request's params with this run's turn stops."""
        return dataclasses.replace(params, turn_stops=self.stops, turn_max_tokens=self.turn_max_tokens)

    def round(self, svc, rows: list[dict]) -> "TurnRound":
        return TurnRound(self, svc, rows)


class TurnRound:
    """One rollout's trajectories (see the module docstring); keys are (prompt, sample) pairs."""

    def __init__(self, mt: MultiTurn, svc, rows: list[dict]):
        self.mt, self.svc = mt, svc
        self.names, self.envs, self.rows = [], [], []
        r = mt.cfg.rewards
        for row in rows:
            name = env_name(row, mt.default)
            env = make_env(name)        # (the row's reward as the single-turn trainer resolves it: ToolEnv's answer)
            opening = env.reset({**row, "reward": reward_name(row, r.fn, r.registry, default=reward_fn_for)})
            if not isinstance(opening, str):
                raise TypeError(f"{type(env).__name__}.reset returned {type(opening).__name__}, not the opening text")
            self.names.append(name)
            self.envs.append(env)
            self.rows.append({**row, "prompt": row["prompt"] + opening} if opening else row)
        self.live: dict[tuple[int, int], Trajectory] = {}
        self.counters: Counter = Counter()
        self.first_error = ""

    @property
    def pending(self) -> int:
        """Environment steps in flight (a trajectory paused in the engine waits on one)."""
        return self.mt.runner.pending

    def start(self, p: int, rids: list[int], params: SamplingParams) -> None:
        """Prompt `p`'s requests were added with `params`: each sample's trajectory starts with a copy of the
        row's env."""
        for j, rid in enumerate(rids):
            self.live[p, j] = Trajectory(rid, copy.deepcopy(self.envs[p]), params.max_new_tokens)
            self.mt.runner.forget((p, j))     # (keys repeat across rollouts: the runner's turn count starts at 0)

    def turn_ended(self, key, c: Completion) -> None:
        """A completion of trajectory `key` came out of the engine (a turn stop, or its end): step its env. A
        trajectory given up already (the race aborted it while this step was in flight) is dropped, its pages
        freed if it paused."""
        t = self.live.get(key)
        if t is None:
            if c.finish_reason == "turn":
                try:
                    self.svc.finish(c.request_id)
                except KeyError:          # (the abort removed it)
                    pass
            return
        since = c.appended[-1][1] if c.appended else 0
        t.last, t.ended, t.turns = c, c.finish_reason != "turn", t.turns + 1
        self.mt.runner.submit(key, t.env, self.mt.tokenizer.decode(c.tokens[since:]))

    def cancel(self, key) -> None:
        """Trajectory `key` was given up (tail batching's race aborted it): drop its step in flight."""
        if self.live.pop(key, None) is not None:
            self.mt.runner.cancel(key)

    def poll(self, timeout: float = 0.0) -> list[tuple]:
        """`(key, final completion, reward, status)` of each trajectory that ended; continues the others.
        `rollout.turns.deterministic`: waits for every step in flight (else up to `timeout` for one)."""
        out, runner = [], self.mt.runner
        if self.mt.deterministic:           # every step submitted so far, applied in trajectory order
            got = []
            while runner.pending:           # (each step ends within its hard timeout)
                got += runner.poll(timeout=1.0)
            got.sort(key=lambda r: r[0])
        else:
            got = runner.poll(timeout)
        for key, env, step in got:
            t = self.live.get(key)
            if t is None:
                continue
            t.env, t.reward = env, t.reward + step.reward
            status = step.info.get("status", "ok")
            self._count(step, status, key)
            c = t.last
            if not (t.ended or step.done):
                obs = self.mt.tokenizer.encode(self.mt.format.render(step.observation))
                if len(c.tokens) + len(obs) < t.budget:
                    self.svc.add_tokens(t.rid, obs)
                    self.counters["observation_tokens"] += len(obs)
                    continue
                self.counters["truncated"] += 1       # the observation leaves no room to generate
            if not t.ended:
                c = self.svc.finish(t.rid)
            del self.live[key]
            self.mt.runner.forget(key)
            self._count_trajectory(c, t.turns)
            out.append((key, c, t.reward, status))
        return out

    def _count(self, step, status: str, key) -> None:
        self.counters.update({k: v for k, v in step.info.items() if isinstance(v, (int, float))})
        self.counters["steps"] += 1
        if status != "ok":
            self.counters[FAILED[status]] += 1
            if not self.first_error:
                self.first_error = one_line(f"{status} in environment {self.names[key[0]]}: {step.observation}", 500)

    def _count_trajectory(self, c: Completion, turns: int) -> None:
        self.counters["trajectories"] += 1
        self.counters["turns"] += turns
        self.counters["turns_max"] = max(self.counters["turns_max"], turns)
        self.counters["prefill_saved"] += sum(len(c.prompt) + a for a, _ in c.appended)

    def stats(self) -> dict:
        """What `rollout_and_score` reports for the reward guard: env steps as items, failed ones as timeouts
        and crashes, the first failure; the counters under "env"."""
        n = self.counters
        return dict(items=n["steps"], timeouts=n["step_timeouts"], crashes=n["step_crashes"],
                    first_error=self.first_error, env=Counter(n))


SUMMED = ("trajectories", "turns", "steps", "tool_calls", "tool_errors", "format_errors", "tool_seconds",
          "env_errors", "step_timeouts", "step_crashes", "turn_limit", "truncated", "observation_tokens",
          "prefill_saved")


def merge_counters(a: Counter, b: Counter) -> Counter:
    """Two rounds' counters (dynamic sampling's waves) as one: sums, and the larger `turns_max`."""
    out = Counter({k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)})
    out["turns_max"] = max(a.get("turns_max", 0), b.get("turns_max", 0))
    return out


def env_metrics(counters) -> dict:
    """The `env/` metrics of a rollout's counters, over all processes: the sums, turns per trajectory (mean and
    max), tool calls per trajectory and the tool success rate (calls that ran without error, of all calls including malformed ones)."""
    n = dict(zip(SUMMED, (float(x) for x in global_sum([float(counters.get(k, 0)) for k in SUMMED]))))
    out = {f"env/{k}": int(v) if k != "tool_seconds" else v for k, v in n.items()}
    out["env/turns_mean"] = n["turns"] / max(n["trajectories"], 1.0)
    out["env/turns_max"] = int(global_max(int(counters.get("turns_max", 0))))
    out["env/tool_calls_mean"] = n["tool_calls"] / max(n["trajectories"], 1.0)
    out["env/tool_success"] = (n["tool_calls"] - n["tool_errors"]) / max(n["tool_calls"] + n["format_errors"], 1.0)
    return out
