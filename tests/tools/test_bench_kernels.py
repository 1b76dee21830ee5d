"""tools/bench_kernels.py on CPU at a tiny shape: a JSON row per implementation with the median, the
first call apart from it, the GEMM floor and the ratio to it, and the GEMM passes (3 with the hint)."""

import json

import pytest

from tools.bench_kernels import main, summary


@pytest.mark.slow
def test_bench_kernels_rows_on_cpu(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rows = main(
        ["--device", "cpu", "--tokens", "32", "--hidden", "16", "--vocab", "128", "--repeats", "3"]
        + ["--json", str(path)]
    )
    assert json.loads(path.read_text()) == rows
    assert [r["impl"] for r in rows] == ["naive", "fused", "fused-hint"]
    assert [r["gemm_passes"] for r in rows] == [None, 4, 3]
    for row in rows:
        assert row["fwd_bwd_ms"] > 0 and row["first_call_ms"] > 0 and row["gemm_floor_ms"] > 0
        assert row["ratio_to_gemm_floor"] > 0 and len(row["times_ms"]) == 3  # the median's runs, after the first
    err = capsys.readouterr().err
    assert all(summary(r) in err for r in rows)
    assert "first call" in summary(rows[0]) and "GEMM floor" in summary(rows[0])
