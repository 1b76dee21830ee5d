"""parallel/cpu_compat.py on a machine without CUDA: what megatron-core asks of torch.cuda is answered on CPU."""

import pytest
import torch

from remax_megatron.parallel import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU accommodations are inert with CUDA")


def test_the_current_stream_waits_for_nothing():
    """megatron-core 0.19's start_grad_sync takes torch.cuda.current_stream() on every grad sync and waits on it
    for CUDA-graph events: on CPU that stream exists and its waits return."""
    cpu_compat.install()
    stream = torch.cuda.current_stream()
    assert stream is torch.cuda.current_stream()
    stream.wait_event(object())
    stream.wait_stream(stream)
    stream.synchronize()
    assert torch.cuda.current_device() == "cpu"
