"""tools/bench_attention.py runs on CPU: both implementations, a JSON row each, with a window and a sink too."""

import json

import pytest

from tools.bench_attention import main


@pytest.mark.slow
def test_bench_attention_runs_on_cpu(tmp_path):
    path = tmp_path / "bench.json"
    tiny = ["--device", "cpu", "--seq", "24", "--batch", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"]
    result = main([*tiny, "--repeats", "3", "--window", "5", "--sink", "--json", str(path)])
    assert json.loads(path.read_text()) == result
    assert [r["impl"] for r in result["rows"]] == ["sdpa", "megatron"]
    for row in result["rows"]:
        assert row["fwd_bwd_ms"] > 0 and row["peak_mib"] >= 0
    assert result["seq"] == 24 and result["window"] == 5 and result["sink"] is True


def test_bench_attention_refuses_too_few_repeats():
    with pytest.raises(SystemExit):
        main(["--repeats", "2"])
