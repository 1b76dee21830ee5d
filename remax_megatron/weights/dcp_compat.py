"""torch >= 2.15 with megatron-core's checkpoint reader: DCP tensor metadata gained a `strides` field.

torch 2.15 added `strides` to `torch.distributed.checkpoint.metadata.TensorProperties` (pytorch PR
#175011). megatron-core (0.16.1 `dist_checkpointing/strategies/torch.py:837`, 0.19.2 `:1022`) builds
a meta tensor per saved tensor with `torch.empty(size, **properties.__dict__, device="meta")`, and
`torch.empty` has no `strides` argument: every checkpoint read (`load_tensors_metadata`, and through
it `dist_checkpointing.load`, resume and conversion) fails with `TypeError: empty() got an unexpected
keyword argument 'strides'`, on GPU and CPU alike.

`install()` wraps `TorchDistLoadShardedStrategy.load_tensors_metadata` so that megatron reads the
metadata through a copy whose tensor properties leave out `strides` (a meta tensor of the saved size
is contiguous whatever the saved strides were; megatron uses it only for its shape and dtype). The
checkpoint's own metadata object is not changed. It is called where the project reads checkpoints
(weights/megatron_ckpt.py, at import), on every machine.

Active only while it is needed: torch's TensorProperties has `strides` AND megatron-core's
`load_tensors_metadata` still passes `properties.__dict__` to a factory. Remove this module when the
oldest supported megatron-core no longer does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import types

from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

_installed = False


def torch_has_strides() -> bool:
    return "strides" in {f.name for f in dataclasses.fields(TensorProperties)}


def _megatron_passes_properties(method) -> bool:
    try:
        return "properties.__dict__" in inspect.getsource(method)
    except (OSError, TypeError):  # no source to read: assume the known behaviour
        return True


def without_strides(metadata):
    """A shallow copy of a DCP `Metadata` whose tensor entries' properties carry no `strides`."""
    md = copy.copy(metadata)
    md.state_dict_metadata = {
        k: dataclasses.replace(
            v,
            properties=types.SimpleNamespace(
                **{name: value for name, value in vars(v.properties).items() if name != "strides"}
            ),
        )
        if isinstance(v, TensorStorageMetadata)
        else v
        for k, v in metadata.state_dict_metadata.items()
    }
    return md


def strides_tolerant(load_tensors_metadata):
    """megatron's `load_tensors_metadata(self, checkpoint_dir, metadata=None)`, fed metadata without strides."""

    @functools.wraps(load_tensors_metadata)
    def wrapper(self, checkpoint_dir, metadata=None):
        if metadata is None:
            from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

            metadata = mcore_torch._get_filesystem_reader(checkpoint_dir).read_metadata()
        return load_tensors_metadata(self, checkpoint_dir, without_strides(metadata))

    wrapper.strides_tolerant = True
    return wrapper


def install() -> None:
    """Make megatron-core's checkpoint reader accept torch 2.15's metadata (module docstring). Idempotent."""
    global _installed
    if _installed:
        return
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy as strategy

    method = strategy.load_tensors_metadata
    if torch_has_strides() and _megatron_passes_properties(method) and not getattr(method, "strides_tolerant", False):
        strategy.load_tensors_metadata = strides_tolerant(method)
    _installed = True
