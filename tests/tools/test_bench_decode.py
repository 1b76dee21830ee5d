"""tools/bench_decode.py on a tiny random model: the new decode loop and the old one on the same engine, every
workload, the JSON (medians and their ratio; the full workload decodes every row to its limit)."""

import json
import statistics

from tools.bench_decode import main
from tools.make_tiny_model import make_tiny_model


def test_every_workload_times_both_loops(tmp_path, capsys):
    hf = make_tiny_model(str(tmp_path / "hf"), "llama", hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, vocab=300)
    out = tmp_path / "decode.json"
    args = ["--hf-dir", hf, "--prompts", "2", "--prompt-len", "5", "--max-new-tokens", "6", "--repeats", "3"]
    result = main(args + ["--threads", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == result
    rows = {r["workload"]: r for r in result["results"]}
    assert set(rows) == {"arith", "random", "full"}
    for r in rows.values():
        assert r["rows"] == 2 * 3 and len(r["new_times_ms"]) == len(r["old_times_ms"]) == 3
        assert r["new_ms"] == round(statistics.median(r["new_times_ms"]), 3)
        assert abs(r["new_over_old"] - r["new_ms"] / r["old_ms"]) < 1e-3
    assert rows["full"]["tokens"] == 6 * 6  # EOS off: every row runs to its limit
