"""tools/plot_metrics.py writes a PNG of a run's metrics."""

import json

from tools.plot_metrics import main


def test_plot_writes_png(tmp_path):
    rows = [{"step": 0, "eval/reward_mean": 0.1}] + [
        {"step": s, "loss": 1.0 / s, "reward/sampled_mean": s / 10} for s in range(1, 6)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main([str(tmp_path)])
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_without_matplotlib_the_error_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import sys

    import pytest

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the [plot] extra gives
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path)])
    assert (
        e.value.code == "error: tools/plot_metrics.py needs matplotlib: pip install -e .[plot] (or pip install "
        "matplotlib)"
    )
    assert not (tmp_path / "curves.png").exists()
