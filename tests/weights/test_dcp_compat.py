"""weights/dcp_compat.py: megatron-core reads checkpoint metadata that carries torch 2.15's `strides`.

torch 2.15 added `strides` to DCP's TensorProperties; megatron-core passes the properties' fields to
`torch.empty`, which has no such argument. The metadata here is built by hand with `strides` set (on an
older torch as an extra attribute, which is what megatron sees either way: the instance's __dict__)."""

import dataclasses

import pytest
import torch
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from remax_megatron.weights import dcp_compat, megatron_ckpt  # noqa: F401 (megatron_ckpt installs the fix)


def _metadata_with_strides():
    props = TensorProperties(dtype=torch.bfloat16)
    props.strides = (3, 1)
    entry = TensorStorageMetadata(
        properties=props,
        size=torch.Size([2, 3]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))],
    )
    return Metadata(state_dict_metadata={"decoder.w": entry})


def _megatrons_own():
    method = TorchDistLoadShardedStrategy.load_tensors_metadata
    return getattr(method, "__wrapped__", method)


def test_megatron_alone_refuses_metadata_with_strides():
    """The failure the fix exists for (if this passes, megatron-core handles strides: remove dcp_compat)."""
    with pytest.raises(TypeError, match="strides"):
        _megatrons_own()(TorchDistLoadShardedStrategy(), "unused", _metadata_with_strides())


def test_metadata_with_strides_reads_as_the_saved_shapes_and_dtypes():
    metadata = _metadata_with_strides()
    got = dcp_compat.strides_tolerant(_megatrons_own())(TorchDistLoadShardedStrategy(), "unused", metadata)
    assert list(got) == ["decoder.w"]
    assert tuple(got["decoder.w"].global_shape) == (2, 3) and got["decoder.w"].dtype == torch.bfloat16
    # the checkpoint's own metadata is not changed
    assert metadata.state_dict_metadata["decoder.w"].properties.strides == (3, 1)


def test_the_fix_is_installed_exactly_when_torch_has_strides():
    installed = getattr(TorchDistLoadShardedStrategy.load_tensors_metadata, "strides_tolerant", False)
    assert installed == ("strides" in {f.name for f in dataclasses.fields(TensorProperties)})
    dcp_compat.install()  # idempotent: never wrapped twice
    inner = getattr(TorchDistLoadShardedStrategy.load_tensors_metadata, "__wrapped__", None)
    assert not getattr(inner, "strides_tolerant", False)
