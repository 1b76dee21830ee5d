"""A failure inside a stage of the step is one line naming the step, the stage, the rank and the
cause (what a user sees when a peer dies or a collective times out)."""

import socket
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from remax_megatron.trainer import StageError, Trainer


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_stage_error_names_step_stage_rank_and_cause(one_rank):
    trainer = SimpleNamespace(step=6)
    times = {}
    with pytest.raises(StageError) as e:
        with Trainer._stage(trainer, "rollout", times):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:29500\nsecond line of a gloo trace")
    assert str(e.value) == (
        "step 7, stage 'rollout' failed on rank 0: RuntimeError: Connection closed by peer [127.0.0.1]:29500"
    )
    assert "time/rollout_s" not in times  # a failed stage is not timed as if it had run


def test_stage_error_is_not_wrapped_twice_and_other_errors_pass(one_rank):
    trainer = SimpleNamespace(step=0)
    inner = StageError("step 1, stage 'sync' failed on rank 1: DistBackendError: timeout")
    with pytest.raises(StageError) as e:
        with Trainer._stage(trainer, "reward", {}):
            raise inner
    assert e.value is inner
    with pytest.raises(ValueError, match="bad reward"):  # input errors keep their own one-line message
        with Trainer._stage(trainer, "reward", {}):
            raise ValueError("bad reward")
