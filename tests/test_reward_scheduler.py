"""RewardScheduler: per-response results with elapsed time, groups reported as their last member is scored,
cancellation (queued, running, scored, whole groups), adaptive code timeouts and their checkpointed anchors.

One module-scoped pool (2 workers) serves every test; `jaxrl.rewards._testing:sleep_then_one` sleeps
`float(response)` seconds and scores 1. Wall-time bounds are hang guards, not performance assertions.
"""

import json
import os
import time
import uuid

import pytest

from jaxrl.rewards import AdaptiveTimeouts, RewardPool, RewardScheduler, SandboxLimits, case_keys

SLEEP = "jaxrl.rewards._testing:sleep_then_one"
UID_BASE = 0x2C000000
LIMITS = SandboxLimits(uid_base=UID_BASE)
ANSWER = json.dumps({"tests": [{"stdin": "3\n", "stdout": "9\n"}, {"stdin": "4\n", "stdout": "16\n"}]})
SQUARE = "print(int(input())**2)"


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=10.0) as p:
        yield p


def sleep_item(seconds):
    return (SLEEP, str(seconds), "", "")


def drain(sched, timeout=15.0):
    out = sched.drain(timeout=timeout)
    assert sched.pending == 0, "hang guard"
    return out


def live_with_marker(marker):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state not in "ZX":
            found.append(pid)
    return found


# ------------------------------------------------------------------------------------- adaptive policy
def test_adaptive_timeout_formula_and_anchors():
    p = AdaptiveTimeouts(lam=1.5, t_min=2.0, t_max=30.0)
    assert p.timeout_for("c") == 30.0                       # no correct run yet: T_max
    p.observe("c", 0.4, correct=False)                      # failures never anchor
    assert p.timeout_for("c") == 30.0
    p.observe("c", 0.4, correct=True)
    assert p.timeout_for("c") == 2.0                        # max(T_min, 1.5 * 0.4)
    p.observe("c", 4.0, correct=True)
    assert p.timeout_for("c") == 6.0                        # 1.5 * the longest correct run
    p.observe("c", 1.0, correct=True)
    assert p.timeout_for("c") == 6.0                        # the anchor is the maximum
    p.observe("c", 25.0, correct=True)
    assert p.timeout_for("c") == 30.0                       # capped at T_max
    assert AdaptiveTimeouts(enabled=False).timeout_for("c") == 30.0
    with pytest.raises(ValueError):
        AdaptiveTimeouts(t_min=5.0, t_max=1.0)


def test_adaptive_state_round_trips_through_json():
    p = AdaptiveTimeouts(lam=2.0, t_min=0.5, t_max=9.0)
    p.observe("a:0", 1.25, True)
    p.observe("b:1", 3.0, True)
    q = AdaptiveTimeouts(lam=2.0, t_min=0.5, t_max=9.0)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.anchors == p.anchors and q.timeout_for("a:0") == 2.5 and q.timeout_for("b:1") == 6.0
    with pytest.raises(ValueError, match="anchors"):
        q.load_state_dict({})


# ------------------------------------------------------------------------------------- groups / elapsed
def test_groups_complete_as_their_last_member_is_scored(pool):
    sched = RewardScheduler(pool)
    sched.submit("a0", sleep_item(0.0), group="A", group_size=2)
    sched.submit("b0", sleep_item(0.0), group="B", group_size=2)
    sched.submit("b1", sleep_item(0.1), group="B")
    seen, groups = [], []
    end = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < end:
        out = sched.poll(timeout=0.5)
        seen += out.responses
        groups += out.groups
    assert [g.group for g in groups] == ["B"]               # A still waits for its second member
    (b,) = groups
    assert b.keys == ["b0", "b1"] and b.scores == [1.0, 1.0] and b.elapsed_s >= 0.1 and b.wait_s <= b.elapsed_s
    by_key = {r.key: r for r in seen}
    assert by_key["b1"].seconds >= 0.1 and by_key["b1"].elapsed_s >= by_key["b1"].seconds
    assert by_key["a0"].group == "A" and by_key["a0"].status == "ok"
    sched.submit("a1", sleep_item(0.0), group="A")
    out = drain(sched)
    assert [r.key for r in out.responses] == ["a1"] and [g.group for g in out.groups] == ["A"]
    assert out.groups[0].keys == ["a0", "a1"]
    sched.submit("x", sleep_item(0.0), group="A", group_size=1)   # a completed group id can be reused
    assert [g.keys for g in drain(sched).groups] == [["x"]]


def test_submit_rejects_misuse(pool):
    sched = RewardScheduler(pool)
    with pytest.raises(ValueError, match="group_size"):
        sched.submit("k", sleep_item(0), group="G")
    sched.submit("k", sleep_item(0), group="G", group_size=1)
    with pytest.raises(ValueError, match="already submitted"):
        sched.submit("k", sleep_item(0))
    with pytest.raises(ValueError, match="already has its 1 members"):
        sched.submit("k2", sleep_item(0), group="G")
    with pytest.raises(ValueError, match="has size 1"):
        sched.submit("k3", sleep_item(0), group="G", group_size=2)
    with pytest.raises(KeyError, match="unknown reward"):
        sched.submit("k4", ("nope", "", "", ""))
    drain(sched)


# ------------------------------------------------------------------------------------- cancellation
def test_cancel_queued_running_and_scored_members(pool):
    sched = RewardScheduler(pool)
    for k in range(4):   # two run (two workers), two wait in the queue
        sched.submit(f"g{k}", sleep_item(0.6 if k < 2 else 0.0), group="G", group_size=4)
    time.sleep(0.2)
    assert sched.cancel("g3") == "queued"
    assert sched.cancel("g0") == "running"                  # not code: its result is discarded on arrival
    assert sched.cancel("nope") == "unknown"
    out = drain(sched)
    assert sorted(r.key for r in out.responses) == ["g1", "g2"]
    assert [(g.keys, g.scores) for g in out.groups] == [(["g1", "g2"], [1.0, 1.0])]   # shrunk to 2
    m = sched.metrics()
    assert m["reward/cancelled"] == 2 and m["reward/cancelled/queued"] == 1 and m["reward/cancelled/running"] == 1
    assert m["reward/items"] == 2

    # a member scored already, then withdrawn before its group completed; shrink=False waits for a replacement
    sched.submit("h0", sleep_item(0), group="H", group_size=2)
    first = drain(sched)
    assert [r.key for r in first.responses] == ["h0"] and first.groups == []
    assert sched.cancel("h0", shrink=False) == "scored"
    sched.submit("h1", sleep_item(0), group="H")
    assert sched.poll().groups == [] and drain(sched).groups == []      # still 1 of 2
    sched.submit("h2", sleep_item(0), group="H")
    assert [g.keys for g in drain(sched).groups] == [["h1", "h2"]]


def test_cancel_group_and_resize_group(pool):
    sched = RewardScheduler(pool)
    sched.submit("p0", sleep_item(0.3), group="P", group_size=3)
    sched.submit("p1", sleep_item(0.0), group="P")
    assert sched.cancel_group("P") == 2 and sched.pending == 0
    assert drain(sched) == ([], [])
    # tail batching: 4 samples launched, keep the first 2 finishers
    sched.submit("q0", sleep_item(0), group="Q", group_size=4)
    sched.submit("q1", sleep_item(0), group="Q")
    out = drain(sched)
    assert out.groups == []
    sched.resize_group("Q", 2)
    out = sched.poll()
    assert [(g.group, g.keys) for g in out.groups] == [("Q", ["q0", "q1"])]
    with pytest.raises(KeyError):
        sched.resize_group("Q", 1)


# ------------------------------------------------------------------------------------- code items
def test_code_items_get_adaptive_timeouts_and_update_anchors(pool):
    policy = AdaptiveTimeouts(lam=1.5, t_min=0.5, t_max=4.0)
    sched = RewardScheduler(pool, policy, limits=LIMITS)
    sched.submit("ok", ("code", SQUARE, ANSWER, "code"), group=0, group_size=3)
    sched.submit("wrong", ("code", "print(1)", ANSWER, "code"), group=0)
    out = drain(sched)
    scores = {r.key: r.score for r in out.responses}
    assert scores == {"ok": 1.0, "wrong": 0.0}
    info = {r.key: r.info for r in out.responses}
    assert [c["correct"] for c in info["ok"]["cases"]] == [True, True]
    assert [c["reason"] for c in info["wrong"]["cases"]] == ["wrong_answer", "wrong_answer"]
    keys = case_keys(ANSWER)
    assert set(policy.anchors) == set(keys)                 # only the correct run anchors
    assert all(policy.anchors[k] == c["seconds"] for k, c in zip(keys, info["ok"]["cases"]))
    assert [policy.timeout_for(k) for k in keys] == [0.5, 0.5]   # max(T_min, 1.5 * a few ms)

    start = time.monotonic()
    sched.submit("hang", ("code", "while True: pass", ANSWER, "code"), group=0)
    out = drain(sched)
    assert time.monotonic() - start < 4.0                   # cut at 0.5 s, not T_max = 4 s
    (hang,) = out.responses
    assert hang.score == 0.0 and [(c["status"], c["seconds"]) for c in hang.info["cases"]] == [("timeout", 0.5)]
    assert hang.info["skipped"] == 1
    assert [g.scores for g in out.groups] == [[1.0, 0.0, 0.0]]
    m = sched.metrics()
    assert m["reward/case_timeout/wall_time"] == 1 and m["reward/case_timeouts"] == 1
    assert m["reward/saved_s"] == pytest.approx(3.5) and m["reward/adaptive_timeout_max_s"] == 4.0
    assert m["reward/case_ok"] == 2 and m["reward/case_wrong"] == 2 and m["reward/anchored_cases"] == 2

    resumed = RewardScheduler(pool, AdaptiveTimeouts(lam=1.5, t_min=0.5, t_max=4.0), limits=LIMITS)
    resumed.load_state_dict(json.loads(json.dumps(sched.state_dict())))
    assert resumed.timeouts.anchors == policy.anchors


def test_fixed_timeouts_when_no_policy(pool):
    sched = RewardScheduler(pool, limits=LIMITS)           # AdaptiveTimeouts(enabled=False): T_max each
    sched.submit("a", ("code", SQUARE, ANSWER, "code"))
    drain(sched)
    sched.submit("b", ("code", SQUARE, ANSWER, "code"))
    drain(sched)
    m = sched.metrics()
    assert m["reward/adaptive_timeout_mean_s"] == 30.0 and m["reward/case_ok"] == 4


def test_malformed_code_answer_is_a_counted_crash(pool):
    sched = RewardScheduler(pool, limits=LIMITS)
    sched.submit("bad", ("code", SQUARE, '{"tests": []}', "code"))
    (r,) = drain(sched).responses
    assert r.status == "crash" and "non-empty 'tests'" in r.error and r.score == 0.0
    assert sched.metrics()["reward/crashes"] == 1


def test_cancel_running_code_item_kills_its_sandbox(pool):
    marker = f"sched-cancel-{uuid.uuid4().hex}"
    program = ("import os, sys\n"
               f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])")
    sched = RewardScheduler(pool, limits=LIMITS)           # T_max = 30 s: without the kill it would hold a worker
    sched.submit("doomed", ("code", program, ANSWER, "code"))
    end = time.monotonic() + 20
    while not live_with_marker(marker) and time.monotonic() < end:
        time.sleep(0.05)
    assert live_with_marker(marker), "the program never started"
    assert sched.cancel("doomed") == "running"
    end = time.monotonic() + 5
    while live_with_marker(marker) and time.monotonic() < end:
        time.sleep(0.05)
    assert live_with_marker(marker) == []
    assert pool.total_cancelled >= 1
    sched.submit("after", ("code", SQUARE, ANSWER, "code"))   # the worker was replaced; scoring goes on
    assert [r.score for r in drain(sched, timeout=30).responses] == [1.0]


# ------------------------------------------------------------------------------------- config sections
def test_config_sections_validate_and_build():
    from jaxrl.config.base import ConfigError, decode
    from jaxrl.config.rewards import AdaptiveTimeoutSection, SandboxSection

    sb = decode(SandboxSection, {"memory_mb": 512, "max_processes": 8, "isolation": "namespaces", "cpu_s": 3})
    limits = SandboxLimits.from_config(sb)
    assert (limits.memory_bytes, limits.max_processes, limits.isolation, limits.cpu_seconds) == \
        (512 << 20, 8, "namespaces", 3)
    assert SandboxLimits.from_config(SandboxSection()) == SandboxLimits()
    at = decode(AdaptiveTimeoutSection, {"lam": 2.0, "t_min": 1, "t_max": 10.0})
    policy = AdaptiveTimeouts.from_config(at)
    assert (policy.lam, policy.t_min, policy.t_max, policy.enabled) == (2.0, 1.0, 10.0, True)
    assert AdaptiveTimeouts.from_config(AdaptiveTimeoutSection(enabled=False)).timeout_for("x") == 30.0
    with pytest.raises(ConfigError, match="isolation: 'chroot' is not a valid choice"):
        decode(SandboxSection, {"isolation": "chroot"})
    with pytest.raises(ConfigError, match="max_processes: must be >= 1"):
        decode(SandboxSection, {"max_processes": 0})
    with pytest.raises(ConfigError, match="t_min: 40.0 > t_max=30.0"):
        decode(AdaptiveTimeoutSection, {"t_min": 40.0})
    with pytest.raises(ConfigError, match="unknown key"):
        decode(AdaptiveTimeoutSection, {"lambda": 1.5})
