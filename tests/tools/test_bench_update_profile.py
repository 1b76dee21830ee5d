"""tools/bench_update_profile.py: the update's profile breakdown on CPU (--small), and the attribution of
backward ops to the module whose forward created them."""

import pytest
import torch

from tests._dist import run_distributed


def test_backward_ops_take_their_forward_label():
    """A Linear labelled `mlp` in the forward: its backward GEMMs (run outside any label) count as mlp;
    an unlabelled op as other_ops; the label's own host time as python; nothing twice."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from tools.bench_update_profile import breakdown

    lin = torch.nn.Linear(256, 256)
    x = torch.randn(512, 256, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("remax::update"):
            with record_function("remax::mlp"):
                y = lin(x)
            loss = y.square().sum()
            loss.backward()
    totals, python = breakdown(prof.events(), device=False)
    root = next(e for e in prof.events() if e.name == "remax::update")
    backward_mm = sum(
        e.self_cpu_time_total
        for e in prof.events()
        if e.name == "aten::mm" and e.cpu_parent is not None and "Backward" in e.cpu_parent.name
    )
    assert backward_mm > 0 and totals["mlp"] * 1e6 >= backward_mm
    assert totals["other_ops"] > 0  # square, sum and their backward
    assert sum(totals.values()) + python == pytest.approx(root.cpu_time_total * 1e-6, rel=1e-6)


def _small_body(rank, world, out):
    import json

    from tools.bench_update_profile import measure

    with open(out, "w") as f:
        json.dump(measure("small", 3, None, []), f)


def test_small_update_profile_on_cpu(tmp_path):
    """--small: the categories add up to the profiled update; every part of the update shows up."""
    import json

    out = str(tmp_path / "row.json")
    run_distributed(_small_body, world_size=1, args=(out,))
    row = json.load(open(out))
    parts = row["breakdown_s"]
    assert set(parts) == {
        "attention_core",
        "attention_linear",
        "mlp",
        "logprob_kernel",
        "optimizer",
        "all_reduce",
        "other_ops",
        "python",
    }
    assert all(v >= 0 for v in parts.values())
    for part in ("attention_core", "attention_linear", "mlp", "logprob_kernel", "optimizer"):
        assert parts[part] > 0, part
    assert row["sum_of_categories_s"] == pytest.approx(row["profiled_update_s"], rel=0.05)
    assert sum(row["breakdown_frac"].values()) == pytest.approx(1.0, abs=0.05)
    assert row["update_s"] > 0 and row["first_update_s"] > 0 and len(row["update_times_s"]) == 3
    assert row["tflops"] > 0 and row["mfu"] is None and row["peak_tflops"] is None  # no known peak on CPU
    # 3 forward passes of 8 rows x 48 tokens, hidden 64, 2 layers, 4 / 2 heads of 16, ffn 128, vocab 512
    per_token = 2 * (2 * 64 * 64 + 2 * 2 * 64 * 32 + 2 * 64 * 64 + 3 * 2 * 64 * 128) + 2 * 64 * 512
    attention = 2 * (2 * 2 * 64 * 48 * 48 / 2)
    assert row["model_flops_per_update"] == 3 * 8 * (48 * per_token + attention)


def test_refuses_too_few_updates_and_unknown_shapes():
    from tools.bench_update_profile import main

    with pytest.raises(SystemExit, match="--updates"):
        main(["--updates", "2"])
    with pytest.raises(SystemExit, match="--shapes"):
        main(["--shapes", "7b"])


def test_device_mode_counts_kernels_once_through_their_cpu_ops():
    """CUDA profiles list the kernels' own events beside the CPU ops that launched them: only the CPU ops'
    self device time counts; a backward op takes its forward op's label; collectives are all_reduce."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from tools.bench_update_profile import breakdown

    def ev(name, start, device_us, parent=None, seq=-1, kind=DeviceType.CPU):
        return SimpleNamespace(
            name=name,
            cpu_parent=parent,
            sequence_nr=seq,
            time_range=SimpleNamespace(start=start),
            self_device_time_total=device_us,
            self_cpu_time_total=1.0,
            device_type=kind,
        )

    root = ev("remax::update", 0, 0.0)
    mlp = ev("remax::mlp", 1, 0.0, root)
    fwd = ev("aten::mm", 2, 300.0, mlp, seq=7)
    kernel = ev("sm90_xmma_gemm", 3, 300.0, kind=DeviceType.CUDA)  # fwd's kernel, listed on its own too
    bwd = ev("autograd::engine::evaluate_function: MmBackward0", 4, 0.0, seq=7)
    bwd_mm = ev("aten::mm", 5, 600.0, bwd)
    nccl = ev("nccl:all_reduce", 6, 50.0, root)
    logp = ev("autograd::engine::evaluate_function: _FusedLogprobsFnBackward", 7, 80.0)
    totals, python = breakdown([root, mlp, fwd, kernel, bwd, bwd_mm, nccl, logp], device=True)
    assert totals["mlp"] == pytest.approx(900e-6)
    assert totals["all_reduce"] == pytest.approx(50e-6) and totals["logprob_kernel"] == pytest.approx(80e-6)
    assert sum(totals.values()) == pytest.approx(1030e-6) and python == 0.0
