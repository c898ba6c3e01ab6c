"""Config of the code sandbox and the adaptive code timeouts (`rewards.sandbox`, `rewards.adaptive_timeout`)."""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_choice, check_float, check_int, check_str

ISOLATIONS = ("auto", "namespaces", "none")   # jaxrl.rewards.sandbox.ISOLATIONS (no import: keep config light)


@dataclasses.dataclass(frozen=True)
class SandboxSection(Section):
    """Limits of every program the `code` reward runs (`jaxrl.rewards.sandbox`; the wall-clock timeout
    per test case comes from `rewards.adaptive_timeout`). `isolation`: "auto" uses PID/network/mount
    namespaces where the kernel allows and says why not otherwise; "namespaces" refuses to run without
    them; "none" keeps only rlimits, the throwaway uid and the kill sweep."""

    memory_mb: int = 1024                # RLIMIT_AS per process
    cpu_s: int | None = None             # RLIMIT_CPU per process; null = the case's timeout rounded up + 2
    file_kb: int = 1024                  # RLIMIT_FSIZE: largest file, stdout and stderr included
    max_processes: int = 16              # RLIMIT_NPROC (processes + threads) of the run's own uid
    open_files: int = 64                 # RLIMIT_NOFILE
    disk_mb: int = 64                    # tmpfs working directory per test case (namespaces only)
    grace_s: float = 5.0                 # supervisor start-up/teardown allowance before it is killed
    isolation: str = "auto"              # auto | namespaces | none
    uid_base: int = 1 << 30              # as root: each run's uid = uid_base + its supervisor's pid
    python: str | None = None            # programs' interpreter; null = this one if an unprivileged uid may run it

    def __post_init__(self):
        for name in ("memory_mb", "file_kb", "max_processes", "open_files", "disk_mb", "uid_base"):
            check_int(name, getattr(self, name), minimum=1)
        if self.cpu_s is not None:
            check_int("cpu_s", self.cpu_s, minimum=1)
        check_float("grace_s", self.grace_s, above=0.0)
        check_choice("isolation", self.isolation, ISOLATIONS)
        check_str("python", self.python, allow_none=True)


@dataclasses.dataclass(frozen=True)
class AdaptiveTimeoutSection(Section):
    """Per-test-case timeout of code rewards (RollPacker §4.3): T = min(max(t_min, lam · T_anchor), t_max),
    T_anchor = the longest run of a correct response on that case so far (t_max before the first);
    `enabled: false` gives every case t_max (the fixed-timeout baseline)."""

    enabled: bool = True
    lam: float = 1.5                     # slack over the slowest correct run (CPU contention)
    t_min: float = 2.0                   # seconds, floor
    t_max: float = 30.0                  # seconds, ceiling and the budget of an unanchored case

    def __post_init__(self):
        check_float("lam", self.lam, above=0.0)
        check_float("t_min", self.t_min, above=0.0)
        check_float("t_max", self.t_max, above=0.0)
        if self.t_min > self.t_max:
            raise ConfigError("t_min", f"{self.t_min} > t_max={self.t_max}")
