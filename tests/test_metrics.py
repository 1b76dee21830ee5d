"""The console side of MetricsLogger: lines printed while the progress bar is up."""

import subprocess
import sys

SCRIPT = """
import sys, warnings
from remax_megatron.metrics import MetricsLogger, print0
log = MetricsLogger(sys.argv[1], total_steps=3, tensorboard=False)
print0("resumed from X at step 0")
log.progress(1, {"loss": 0.5})
log.write("saved checkpoint A")
log.progress(2, {"loss": 0.25})
warnings.warn("careful")
log.progress(3, {"loss": 0.125})
log.close()
print0("done")
"""


def test_lines_printed_beside_the_bar_start_a_line_of_their_own(tmp_path):
    """stdout and stderr into one pipe (`2>&1 | tee log`, or a terminal): a save, a print0 (`resumed from`) and a
    warning each start a line, not glued to the bar's text; before print0 and the warning hook, both were."""
    root = __file__.rsplit("/tests/", 1)[0]
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout
    out = r.stdout.decode()
    for text in ("resumed from X", "saved checkpoint A", "UserWarning: careful", "done"):
        at = out.index(text)
        line_start = max(out.rfind("\n", 0, at), out.rfind("\r", 0, at)) + 1
        assert "remax:" not in out[line_start:at], repr(out[max(0, at - 100) : at + 30])  # not after the bar's text


def test_the_last_line_states_the_eval_the_largest_gap_and_where_the_outputs_are(tmp_path):
    import json

    from remax_megatron.metrics import run_summary

    rows = [
        {"step": 0, "eval/reward_mean": 0.15},
        {"step": 1, "loss": 0.1, "logprob/engine_vs_actor_max_diff": 2e-6},
        {"step": 2, "loss": 0.1, "logprob/engine_vs_actor_max_diff": 9.5e-6},
        {"step": 3, "loss": 0.1, "logprob/engine_vs_actor_max_diff": 1e-6},
        {"step": 3, "eval/reward_mean": 0.95},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_summary(str(tmp_path)) == (
        "done: eval 0.15 -> 0.95 (step 0 -> 3), largest engine-vs-actor log-prob gap 9.5e-06 (step 2); outputs in "
        f"{tmp_path} (metrics.jsonl, config.yaml, checkpoints/)"
    )
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n")  # no eval, no engine gap
    assert run_summary(str(tmp_path)) == (
        f"done: no eval (trainer.eval_every=0); outputs in {tmp_path} (metrics.jsonl, config.yaml, checkpoints/)"
    )
