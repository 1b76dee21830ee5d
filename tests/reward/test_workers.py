"""Reward functions in worker processes (reward/workers.py, reward.workers > 0): a call that hangs or kills
its process costs only its response (timeout_value, counted in reward/timeouts), within timeout_s and a few
seconds; every other response scores exactly what the in-process path gives; a function that raises still
fails as in-process; no worker outlives the pool, or the process that ran it."""

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import resource_tracker

import psutil
import pytest

from remax_megatron.config import RewardConfig
from remax_megatron.data.prompts import Prompt
from remax_megatron.reward import RewardError, RewardFunctions, RewardScorer, RewardWorkers
from remax_megatron.reward.functions import RewardBatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOSTILE = "tests.reward.hostile_rewards"
SPECS = [f"{HOSTILE}:hangs", f"{HOSTILE}:dies", "format", "length_penalty"]
WEIGHTS = [0.3, 1.7, 2.0, -0.9]
OPTIONS = {"limit": 8}
GOOD = ["12", "hello world", " 7 ", "x" * 30, "-3", "a longer answer: 41.5", "", "99 bottles"]
BAD = ["please hang", "now die", "exit here", "segv!"]  # sleeps forever, SIGKILL, os._exit(3), a null read
TIMEOUT_S = 6.0  # generous: on a loaded 2-core machine a fresh worker's first call took over 3 s


def _batch(responses):
    return RewardBatch(
        prompts=[f"p{i}" for i in range(len(responses))],
        responses=list(responses),
        prompt_index=list(range(len(responses))),
    )


def _functions(specs=SPECS, weights=WEIGHTS):
    return RewardFunctions(specs, weights, OPTIONS)


def _children(before=frozenset()) -> set[int]:
    """This process's live children not in `before` (other tests' fork servers) and not multiprocessing's
    resource tracker (started by the first 'spawn', it lives as long as this process, as in every rank
    that saves a checkpoint)."""
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.pid != tracker and p.pid not in before and _alive(p.pid)
    }


@pytest.fixture
def pool():
    p = RewardWorkers(_functions(), workers=2, timeout_s=TIMEOUT_S, timeout_value=-5.0)
    yield p
    p.close()


def _score_within(pool, batch, seconds: float):
    """pool.score(batch), failing the test (not hanging it) when it has not returned within `seconds`."""
    got = []
    thread = threading.Thread(target=lambda: got.append(pool.score(batch)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert got, f"scoring did not return within {seconds} s"
    return got[0]


def test_a_hang_and_a_death_cost_only_their_responses(pool):
    responses = GOOD[:3] + BAD[:2] + GOOD[3:6] + BAD[2:] + GOOD[6:]
    start = time.monotonic()
    total, parts, timed_out = _score_within(pool, _batch(responses), 60)
    elapsed = time.monotonic() - start
    bad = [i for i, r in enumerate(responses) if r in BAD]
    assert timed_out == bad
    assert elapsed < TIMEOUT_S + 5.0, elapsed  # the hang runs beside the others: one limit, plus start-up
    assert [total[i] for i in bad] == [-5.0] * len(bad)
    assert all(parts[s][i] == -5.0 for s in SPECS for i in bad)
    # Every other response: the in-process weighted sum, bit for bit (functions called on the whole batch).
    want_total, want_parts = _functions().score(_batch(GOOD))
    good = [i for i in range(len(responses)) if i not in bad]
    assert [total[i] for i in good] == want_total
    assert {s: [parts[s][i] for i in good] for s in SPECS} == want_parts
    # The dead and the killed workers were replaced: the pool scores on, and the next call times out alike.
    total, _, timed_out = _score_within(pool, _batch(GOOD + ["hang again"]), 60)
    assert total[:-1] == want_total and timed_out == [len(GOOD)]


def test_the_scorer_counts_timeouts_and_workers_0_is_unchanged():
    prompts = [Prompt(index=i, text=f"q{i}", token_ids=[i], columns={}) for i in range(3)]
    texts = [["5", "please hang", "5"], ["now die", "six", "6"], ["7", "7 ", "x" * 12]]
    responses = [[([i, j], t) for j, t in enumerate(row)] for i, row in enumerate(texts)]
    responses[0][2] = responses[0][0]  # a sample equal to the greedy response: scored once
    workers = RewardWorkers(_functions(), workers=2, timeout_s=TIMEOUT_S, timeout_value=0.25)
    try:
        scores, metrics = RewardScorer(_functions(), workers=workers).score(prompts, responses)
    finally:
        workers.close()
    assert metrics["reward/timeouts"] == 2.0 and metrics["reward/unique_scored"] == 8.0
    assert scores[0][1] == 0.25 and scores[1][0] == 0.25
    calm = [[r if "hang" not in r[1] and "die" not in r[1] else ([9], "0") for r in row] for row in responses]
    plain_scores, plain = RewardScorer(_functions()).score(prompts, calm)
    assert "reward/timeouts" not in plain and set(plain) == set(metrics) - {"reward/timeouts"}
    assert [[s for s, r in zip(row, calm_row) if r[1] != "0"] for row, calm_row in zip(scores, calm)] == [
        [s for s, r in zip(row, calm_row) if r[1] != "0"] for row, calm_row in zip(plain_scores, calm)
    ]


def test_a_function_that_raises_fails_as_in_process():
    specs = ["format", f"{HOSTILE}:raises"]
    batch = _batch(["1", "2", "boom", "3", "boom"])
    with pytest.raises(RewardError) as in_process:
        _functions(specs, [1.0, 1.0]).score(batch)
    workers = RewardWorkers(_functions(specs, [1.0, 1.0]), workers=2, timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(RewardError) as pooled:
            workers.score(batch)
    finally:
        workers.close()
    assert (
        str(pooled.value)
        == str(in_process.value)
        == "reward function 'tests.reward.hostile_rewards:raises' raised ArithmeticError: boom (on prompt 2)"
    )


def test_calls_run_side_by_side_without_a_limit(tmp_path, monkeypatch):
    """Two workers' calls overlap in time (each logs its process and its start and end; CLOCK_MONOTONIC is one
    clock for every process): evidence of side-by-side calls that does not depend on the machine's speed."""
    monkeypatch.setenv("REMAX_HOSTILE_DIR", str(tmp_path))  # the workers inherit it at their start
    workers = RewardWorkers(_functions([f"{HOSTILE}:slow"], [1.0]), workers=2)
    try:
        workers.score(_batch(["warm"] * 2))  # start-up
        (tmp_path / "slow.log").unlink()
        total, _, timed_out = workers.score(_batch(["a"] * 8))
    finally:
        workers.close()
    assert total == [1.0] * 8 and timed_out == []
    calls = [line.split() for line in (tmp_path / "slow.log").read_text().splitlines()]
    calls = [(int(pid), float(start), float(end)) for pid, start, end in calls]
    assert len({pid for pid, _, _ in calls}) == 2, calls  # both workers scored
    overlap = [
        (a, b) for a in calls for b in calls if a[0] < b[0] and max(a[1], b[1]) < min(a[2], b[2])
    ]  # two processes' calls running at the same time
    assert overlap, calls


def test_workers_outlive_the_thread_that_scored_first(pool):
    """Linux's parent-death signal follows the thread that started a worker: workers started by a scoring
    thread that then ended were killed, and their next responses scored timeout_value (a flaky CI failure)."""
    _score_within(pool, _batch(GOOD[:2]), 60)  # starts the workers; the scoring thread ends with it
    pids = pool.pids
    time.sleep(0.5)  # the signal, if sent, has landed
    assert all(_alive(p) for p in pids)
    total, _, timed_out = pool.score(_batch(GOOD))
    assert timed_out == [] and total == _functions().score(_batch(GOOD))[0] and pool.pids == pids


def test_no_worker_outlives_close(pool):
    before = _children()  # the pool starts on its first call
    pool.score(_batch(GOOD[:2] + BAD))
    pids = pool.pids
    assert len(pids) == 2 and _children(before) == set(pids)  # the dead and the killed ones reaped already
    pool.close()
    assert _children(before) == set() and not any(_alive(p) for p in pids)
    pool.close()  # idempotent


def _orphans(script: str, tmp_path) -> list[int]:
    """Run `script` (it writes its workers' pids to argv[1], then exits); the workers still alive 10 s
    after it exited (killed then: a broken guard leaves nothing behind)."""
    pid_file = tmp_path / "pids"
    with open(tmp_path / "out", "w") as out:  # not a pipe: a surviving worker would hold it open
        code = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), str(pid_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=60,
        ).returncode
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2, (tmp_path / "out").read_text()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        psutil.Process(p).kill()
    return code, left


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


PREAMBLE = f"""
    import os, sys, threading
    sys.path.insert(0, {ROOT!r})
    from remax_megatron.reward import RewardFunctions, RewardWorkers
    from remax_megatron.reward.functions import RewardBatch
    def started(pool):
        pool.score(RewardBatch(["p"], ["warm"], prompt_index=[0]))
        with open(sys.argv[1], "w") as f:
            f.write(" ".join(map(str, pool.pids)))
        return pool
"""


def test_workers_die_with_the_process_that_ran_them(tmp_path):
    """A rank that exits at once (train._fail: os._exit, no clean-up) while a call hangs leaves no worker."""
    code, left = _orphans(
        PREAMBLE
        + f"""
    if __name__ == "__main__":
        pool = started(RewardWorkers(RewardFunctions(["{HOSTILE}:hangs"]), workers=2))
        threading.Timer(1.0, os._exit, (1,)).start()
        pool.score(RewardBatch(["p", "p"], ["hang", "hang"], prompt_index=[0, 1]))
    """,
        tmp_path,
    )
    assert code == 1 and left == []


def test_an_exit_without_close_ends_the_workers(tmp_path):
    """An exception out of the run (no close()): the interpreter exits, its workers with it."""
    code, left = _orphans(
        PREAMBLE
        + f"""
    if __name__ == "__main__":
        pool = started(RewardWorkers(RewardFunctions(["{HOSTILE}:hangs"]), workers=2))
        raise SystemExit(3)
    """,
        tmp_path,
    )
    assert code == 3 and left == []


@pytest.mark.parametrize(
    "values,message",
    [
        (dict(functions=["format"], timeout_s=5.0), "reward.timeout_s=5.0 needs reward.workers >= 1"),
        (dict(workers=2), "reward.workers=2 runs reward.functions, and there are none"),
        (dict(functions=["format"], workers=-1), "reward.workers=-1 must be >= 0"),
        (dict(functions=["format"], workers=1, timeout_value=float("nan")), "reward.timeout_value=nan is not a finite"),
    ],
)
def test_bad_worker_settings_are_refused_in_one_line(values, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        RewardConfig(**values)


def _agree_body(rank, world, out_dir):
    """Both ranks score the same responses; only rank 1's workers hang on "maybe" (as a call ending near the
    limit may time out on one rank of a model-parallel group only)."""
    import json

    import torch.distributed as dist

    if rank == 1:
        os.environ["REMAX_HANG_ON"] = "maybe"  # the workers inherit it at their start
    functions = _functions([f"{HOSTILE}:hangs_where_told", "format"], [1.0, 1.0])
    workers = RewardWorkers(functions, workers=1, timeout_s=2.0, timeout_value=-1.0)
    prompts = [Prompt(index=i, text=f"q{i}", token_ids=[i], columns={}) for i in range(2)]
    responses = [[([0, 1], "12"), ([0, 2], "maybe 3")], [([1, 1], "4"), ([1, 2], "5 ")]]
    waits = []

    @contextlib.contextmanager
    def wait():
        start = time.perf_counter()
        yield
        waits.append(time.perf_counter() - start)

    try:
        workers.score(_batch(["warm"]))  # started: what follows is scoring alone
        dist.barrier()
        if rank == 1:  # a slow rollout on this rank: rank 0 waits for it, in the wait only
            time.sleep(3.0)
        start = time.perf_counter()
        scores, metrics = RewardScorer(functions, workers=workers, mp_group=dist.group.WORLD).score(
            prompts, responses, wait=wait
        )
        elapsed = time.perf_counter() - start
    finally:
        workers.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"scores": scores, "timeouts": metrics["reward/timeouts"], "waits": waits, "elapsed": elapsed}, f)


@pytest.mark.slow
def test_ranks_that_score_the_same_responses_agree_on_timeouts(tmp_path):
    import json

    from tests._dist import run_distributed

    run_distributed(_agree_body, 2, (str(tmp_path),))
    got = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert got[0]["scores"] == got[1]["scores"] and got[0]["timeouts"] == got[1]["timeouts"] == 1.0
    # Rank 0 scored in well under a second, then waited for rank 1's 3 s "rollout" and 2 s timeout.
    assert [len(g["waits"]) for g in got] == [1, 1] and got[0]["waits"][0] > 4.5
    assert got[0]["elapsed"] - got[0]["waits"][0] < 1.0, got[0]
    want, _ = _functions([f"{HOSTILE}:hangs_where_told", "format"], [1.0, 1.0]).score(_batch(["12", "4", "5 "]))
    assert got[0]["scores"] == [[want[0], -1.0], want[1:]]


def _records(out) -> list[dict]:
    import json

    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_tiny_default_with_reward_workers(tmp_path):
    """The README's launcher on the tiny default (TP=2) with reward.workers=2 reward.timeout_s=5: it trains,
    logs reward/timeouts (0: nothing hangs) and time/wait_s apart from time/reward_s; no worker is left."""
    out = str(tmp_path / "run")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "remax_megatron.launch",
            "--nproc_per_node=2",
            "-m",
            "remax_megatron.train",
            "--config",
            "configs/tiny_cpu.yaml",
            "rollout.engine=native",
            "reward.workers=2",
            "reward.timeout_s=5",
            "trainer.steps=2",
            f"trainer.output_dir={out}",
            "logging.progress_bar=false",
            "checkpoint.save_every=0",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    steps = [rec for rec in _records(out) if "loss" in rec]
    assert [rec["step"] for rec in steps] == [1, 2]
    assert all(
        rec["reward/timeouts"] == 0.0 and rec["time/wait_s"] >= 0.0 and rec["time/reward_s"] >= 0.0 for rec in steps
    )


@pytest.mark.slow
def test_a_hang_and_a_death_in_training_cost_one_limit_and_two_responses(tmp_path):
    """tests.reward.hostile_rewards:once hangs on the job's first scored response and kills its worker on
    another: step 1 counts both as timeouts, its scoring takes the limit and a few seconds, step 2 none."""
    from tests._dist import run_main

    out, hostile = str(tmp_path / "run"), tmp_path / "claims"
    hostile.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", REMAX_HOSTILE_DIR=str(hostile))
    r = run_main(
        "remax_megatron.train",
        [
            "--config",
            "configs/tiny_cpu.yaml",
            "rollout.engine=native",
            f"trainer.output_dir={out}",
            "logging.progress_bar=false",
            "checkpoint.save_every=0",
            "trainer.eval_every=0",
            "trainer.steps=2",
            f"reward.functions=[exact_match,{HOSTILE}:once]",
            "reward.workers=2",
            "reward.timeout_s=5",
            "reward.timeout_value=-1",
        ],
        2,
        env=env,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    first, second = _records(out)
    assert sorted(os.listdir(hostile)) == ["die.claim", "hang.claim", "hung"]
    assert first["reward/timeouts"] == 2.0 and second["reward/timeouts"] == 0.0
    assert first["reward/min"] == -1.0 and second["reward/min"] >= 0.0
    assert first["time/reward_s"] < 5.0 + 4.0, first["time/reward_s"]
