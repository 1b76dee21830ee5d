"""tools/compare_metrics.py: equal runs pass whatever their timings, any other changed value fails."""

import json

from tools.compare_metrics import main


def _run(path, records):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_timings_are_skipped_and_any_other_difference_fails(tmp_path, capsys):
    before = _run(tmp_path / "a", [{"step": 1, "loss": 0.5, "time/step_s": 1.0, "memory/rss_gib_sync": 2.0}])
    same = _run(tmp_path / "b", [{"step": 1, "loss": 0.5, "time/step_s": 9.0, "memory/rss_gib_sync": 3.0}])
    other = _run(tmp_path / "c", [{"step": 1, "loss": 0.5000000001, "time/step_s": 1.0, "memory/rss_gib_sync": 2.0}])
    assert main([before, same]) == 0
    assert main([before, other]) == 1
    out = capsys.readouterr().out
    assert "EQUAL (2 values compared)" in out and "step 1: loss 0.5 != 0.5000000001" in out
