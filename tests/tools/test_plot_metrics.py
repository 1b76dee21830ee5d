"""tools/plot_metrics.py writes a PNG of a run's metrics."""

import json

from tools.plot_metrics import main


def test_plot_writes_png(tmp_path):
    rows = [{"step": 0, "eval/reward_mean": 0.1}] + [{"step": s, "loss": 1.0 / s, "reward/sampled_mean": s / 10}
                                                     for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main([str(tmp_path)])
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
