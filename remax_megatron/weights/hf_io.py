"""Reading and writing Hugging Face safetensors directories.

Reading is lazy and sliced (a TP rank reads only its rows/columns of a tensor);
every file is opened and checked up front so a missing or truncated shard is
reported by name before any model work starts. Writing streams tensors into
size-capped shards plus `model.safetensors.index.json`, inside a temporary
directory that is renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from remax_megatron.models.families import gpt_oss
from remax_megatron.weights import fp8_blocks
from remax_megatron.weights.mxfp4 import dequantize_mxfp4, is_mxfp4, quantized_pairs

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files an HF model directory carries besides the weights.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
# Written last into every directory HFDirWriter makes: which tool wrote it and its files, so that
# `--overwrite` can tell a directory the tool wrote from anything else.
WRITTEN_BY = "remax_written_by.json"


class HFCheckpointReader:
    """The tensors of an HF directory (single file or sharded with an index)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        index_path = os.path.join(model_dir, INDEX)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(model_dir, SINGLE)):
            weight_map = None
        else:
            raise FileNotFoundError(_no_safetensors(model_dir))
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        self._handles = {}
        for name in files:
            path = os.path.join(model_dir, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is listed in {INDEX} but missing: re-download the model")
            self._handles[name] = _open_checked(path)
        if weight_map is None:
            weight_map = {k: SINGLE for k in self._handles[SINGLE].keys()}
        for tensor, name in weight_map.items():
            if tensor not in self._handles[name].keys():
                raise ValueError(f"{INDEX} maps {tensor} to {name} but that file lacks it: re-download the model")
        # MXFP4 (gpt-oss): each `<name>_blocks` / `<name>_scales` pair reads as `<name>`, dequantized.
        self._mxfp4: dict[str, tuple[str, str]] = {}
        config_path = os.path.join(model_dir, "config.json")
        self._config: dict | None = None
        if os.path.isfile(config_path):
            with open(config_path) as f:
                self._config = json.load(f)
            if is_mxfp4(self._config):
                self._mxfp4 = quantized_pairs(weight_map)
        self._file_of_raw = {raw: weight_map[raw] for pair in self._mxfp4.values() for raw in pair}
        for name, (blocks, scales) in self._mxfp4.items():
            weight_map[name] = weight_map.pop(blocks)
            weight_map.pop(scales)
        # FP8 block-quantized weights (DeepSeek-V3): `W_scale_inv` beside `W`, hidden from names() and
        # applied by read(), which returns float32.
        quantization = None if self._mxfp4 else _quantization_config(model_dir)  # MXFP4's is read above
        self.fp8_block = fp8_blocks.block_size_of(quantization, model_dir)
        self._scales = {
            n[: -len(fp8_blocks.SCALE_SUFFIX)]: n
            for n in weight_map
            if n.endswith(fp8_blocks.SCALE_SUFFIX) and n[: -len(fp8_blocks.SCALE_SUFFIX)] in weight_map
        }
        if self._scales and self.fp8_block is None:
            raise ValueError(
                f"{model_dir} has FP8 scales ({next(iter(self._scales.values()))}) but its config.json has no "
                "quantization_config.weight_block_size: restore the checkpoint's config.json"
            )
        self._scale_files = {n: weight_map[n] for n in self._scales.values()}
        self.weight_map = {k: v for k, v in weight_map.items() if k not in self._scale_files}
        # gpt-oss: each layer's fused experts read as one tensor per expert matrix (models/families/gpt_oss.py)
        self._views: dict[str, tuple[str, int, int | None]] = {}
        self._names = list(self.weight_map)
        if isinstance(self._config, dict) and self._config.get("model_type") == "gpt_oss":
            experts = int(self._config.get("num_local_experts", 0))
            self._names = []
            for name in self.weight_map:
                views = gpt_oss.per_expert_names(name, experts)
                self._views.update({v: gpt_oss.split_expert_name(v) for v in views})
                self._names += views or [name]
        self._present = set(self._names)
        self._last_expert: tuple[tuple[str, int], torch.Tensor] | None = None  # gate then up read one slice
        if self.fp8_block is not None:  # headers only: an FP8 tensor with no scales is refused before any work
            for name, file in self.weight_map.items():
                if name not in self._scales and self._handles[file].get_slice(name).get_dtype().startswith("F8"):
                    raise ValueError(
                        f"{model_dir}: tensor {name} is FP8 with no {name}{fp8_blocks.SCALE_SUFFIX} beside it: only "
                        "block-quantized FP8 (DeepSeek-V3's layout) is dequantized; give a bf16 checkpoint"
                    )

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._present

    def tensors(self):
        """(name, tensor) for every tensor, read one at a time (e.g. a weight-sync stream)."""
        for name in self._names:
            yield name, self.read(name)

    def read(
        self, name: str, dim: int | None = None, start: int | None = None, stop: int | None = None
    ) -> torch.Tensor:
        """The tensor `name`, or its slice [start:stop] along `dim`."""
        if name in self._views:
            fused, expert, half = self._views[name]
            if self._last_expert is None or self._last_expert[0] != (fused, expert):
                self._last_expert = ((fused, expert), self._read_stored(fused, 0, expert, expert + 1)[0])
            view = gpt_oss.expert_view(self._last_expert[1], half)
            if dim is not None:
                view = view.narrow(dim, start or 0, (view.shape[dim] if stop is None else stop) - (start or 0))
            return view.contiguous()
        if name not in self._present:
            raise KeyError(f"tensor {name} not found in {self.model_dir}: is this the right model family?")
        return self._read_stored(name, dim, start, stop)

    def _read_stored(self, name: str, dim: int | None, start: int | None, stop: int | None) -> torch.Tensor:
        """A tensor as the files store it (MXFP4 and FP8 dequantized), or its slice [start:stop] along `dim`."""
        if name not in self.weight_map:
            raise KeyError(f"tensor {name} not found in {self.model_dir}: is this the right model family?")
        if name in self._mxfp4:
            return self._read_mxfp4(name, dim, start, stop)
        handle = self._handles[self.weight_map[name]]
        if dim is None:
            tensor = handle.get_tensor(name)
        else:
            sl = handle.get_slice(name)
            index = [slice(None)] * len(sl.get_shape())
            index[dim] = slice(start, stop)
            tensor = sl[tuple(index)]
        if name in self._scales:
            return self._dequantized(name, tensor, dim, start)
        if tensor.dtype in fp8_blocks.FP8_DTYPES:
            raise ValueError(
                f"{self.model_dir}: tensor {name} is {tensor.dtype} with no {name}{fp8_blocks.SCALE_SUFFIX} "
                "beside it: only block-quantized FP8 (DeepSeek-V3's layout) is dequantized; give a bf16 checkpoint"
            )
        return tensor

    def _dequantized(self, name: str, tensor: torch.Tensor, dim: int | None, start: int | None) -> torch.Tensor:
        """float32 `tensor` (the whole of `name`, or its slice from `start` along `dim`) times its block scales."""
        block = self.fp8_block
        offsets = [0, 0]
        scale_name = self._scales[name]
        handle = self._handles[self._scale_files[scale_name]]
        if dim is None or start is None:
            return fp8_blocks.dequantize(tensor, handle.get_tensor(scale_name), block)
        offsets[dim] = start
        first_block = start // block[dim]
        scale = handle.get_slice(scale_name)
        index = [slice(None), slice(None)]
        index[dim] = slice(first_block, None)
        return fp8_blocks.dequantize(tensor, scale[tuple(index)], block, offsets[0], offsets[1])

    def _read_mxfp4(self, name: str, dim: int | None, start: int | None, stop: int | None) -> torch.Tensor:
        """`name` dequantized to float32 (exact: bfloat16 holds it too), [E, in, out]; a slice of the
        experts (dim 0) dequantizes only those."""
        blocks_name, scales_name = self._mxfp4[name]
        blocks = self._raw(blocks_name, 0 if dim == 0 else None, start, stop)
        scales = self._raw(scales_name, 0 if dim == 0 else None, start, stop)
        full = dequantize_mxfp4(blocks, scales, torch.float32, name)
        if dim is None or dim == 0:
            return full
        return full.narrow(dim, start or 0, (full.shape[dim] if stop is None else stop) - (start or 0))

    def _raw(self, name: str, dim: int | None, start: int | None, stop: int | None) -> torch.Tensor:
        handle = self._handles[self._file_of_raw[name]]
        if dim is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[start:stop]

    def dtype(self, name: str) -> torch.dtype:
        if name in self._views:
            return self.dtype(self._views[name][0])
        if name in self._mxfp4:
            return torch.float32
        return self.read(name, 0, 0, 1).dtype


def _quantization_config(model_dir: str) -> dict | None:
    """config.json's quantization_config (None when there is none or no readable config.json)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None


def _no_safetensors(model_dir: str) -> str:
    """Why `model_dir` has no weights this reader takes, and the fix (PyTorch pickles: convert them)."""
    pickles = sorted(n for n in os.listdir(model_dir) if n.endswith((".bin", ".pt", ".pth")))
    if not pickles:
        return f"no {SINGLE} or {INDEX} in {model_dir}: point at a Hugging Face safetensors directory"
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cls = json.load(f)["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        cls = "AutoModelForCausalLM"
    out = model_dir.rstrip("/") + "-safetensors"
    return (
        f"{model_dir} holds {pickles[0]}{' and more' if len(pickles) > 1 else ''} (PyTorch pickle) but no "
        f'safetensors ({SINGLE} or {INDEX}); convert it once: python -c "import transformers as t; '
        f"d, o = '{model_dir}', '{out}'; t.{cls}.from_pretrained(d).save_pretrained(o); "
        f't.AutoTokenizer.from_pretrained(d).save_pretrained(o)" and point at {out}'
    )


def _open_checked(path: str):
    """safe_open `path` after checking the data section its header promises is all there."""
    fix = "re-download or re-convert it"
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if size < 8 or header_len > 100_000_000:  # safetensors caps headers at 100 MB
            raise ValueError(f"{path} is not a readable safetensors file: {fix}")
        if 8 + header_len > size:
            raise ValueError(f"{path} is truncated ({size} bytes, shorter than its header): {fix}")
        try:
            header = json.loads(f.read(header_len))
            data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e}): {fix}") from None
    if size < 8 + header_len + data_end:
        raise ValueError(f"{path} is truncated ({size} bytes, header promises {8 + header_len + data_end}): {fix}")
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises its own error type
        raise ValueError(f"{path} is not a readable safetensors file ({e}): {fix}") from None


def replace_dir(src: str, dst: str) -> None:
    """Rename the finished directory `src` to `dst`; an existing `dst` is moved aside (to a fresh
    hidden sibling, never onto a name a user might own) and deleted only once the new one is in
    place (a crash never leaves neither)."""
    if os.path.lexists(dst):
        old = tempfile.mkdtemp(prefix=".old-" + os.path.basename(dst) + "-", dir=os.path.dirname(dst))
        os.rename(dst, old)  # a directory may be renamed onto an empty one
        os.rename(src, dst)
        shutil.rmtree(old)
    else:
        os.rename(src, dst)


def holds_checkpoint(path: str) -> bool:
    """True when `path` already holds model weights or a Megatron checkpoint."""
    if not os.path.isdir(path):
        return False
    markers = (SINGLE, INDEX, "metadata.json", "model", "latest_checkpointed_iteration.txt")
    return any(os.path.exists(os.path.join(path, m)) for m in markers)


def _describe(path: str, entries: list[str]) -> str:
    """`model/ (3 files), config.json` for the entries of `path` (how much --overwrite removes)."""
    parts = []
    for name in entries:
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            count = sum(len(files) for _, _, files in os.walk(full))
            parts.append(f"{name}/ ({count} file{'s' if count != 1 else ''})")
        else:
            parts.append(name)
    return ", ".join(parts)


def check_out_dir(
    out: str, overwrite: bool, written_by_tool: Callable[[str], list[str] | None], what: str
) -> str | None:
    """Check a tool's `--out` before any work; one-line errors, nothing touched.

    Nothing there (or an empty directory) -> None. A file, or a non-empty directory, is refused
    unless `overwrite` and `written_by_tool(out)` recognises it as `what` this tool wrote before
    (it returns that directory's entries): then the returned line says exactly what replacing
    it removes. A missing parent directory is reported as such.
    """
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"--out {out}: its parent directory {parent} does not exist: create it first")
    if not os.path.lexists(out):
        return None
    if os.path.islink(out) or not os.path.isdir(out):
        kind = "a symbolic link" if os.path.islink(out) else "an existing file, not a directory"
        raise FileExistsError(
            f"--out {out} is {kind}: choose a new --out (--overwrite replaces only {what} this tool wrote)"
        )
    entries = sorted(os.listdir(out))
    if not entries:
        return None
    ours = written_by_tool(out)
    if ours is None:
        shown = _describe(out, entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
        raise FileExistsError(
            f"--out {out} is not empty and is not {what} this tool wrote (it holds {shown}): "
            "choose a new --out; --overwrite does not replace it either"
        )
    if not overwrite:
        raise FileExistsError(f"--out {out} already holds {what}: choose a new --out or pass --overwrite to replace it")
    return f"--overwrite: replacing {what} at {out}, removing {_describe(out, ours)}"


def hf_dir_entries(path: str, tool: str) -> list[str] | None:
    """The entries of `path` when HFDirWriter(tool=tool) wrote it and nothing was added since, else None."""
    try:
        with open(os.path.join(path, WRITTEN_BY)) as f:
            marker = json.load(f)
        written = set(marker["files"]) | {WRITTEN_BY}
        if marker["written_by"] != tool:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    entries = sorted(os.listdir(path))
    return entries if set(entries) <= written else None


class HFDirWriter:
    """Stream (name, tensor) pairs into an HF directory, atomically.

    with HFDirWriter(out_dir, max_shard_bytes=5e9) as w:
        for name, t in tensors: w.add(name, t)
        w.copy_side_files(src_dir)
    """

    def __init__(
        self, out_dir: str, max_shard_bytes: int = 5 * 1024**3, overwrite: bool = False, tool: str = "remax-megatron"
    ):
        out_dir = os.path.abspath(out_dir)
        self.tool = tool  # recorded in WRITTEN_BY
        if holds_checkpoint(out_dir) and not overwrite:
            raise FileExistsError(f"{out_dir} already holds a checkpoint: choose a new --out or pass --overwrite")
        self.out_dir, self.max_shard_bytes = out_dir, int(max_shard_bytes)
        parent = os.path.dirname(out_dir)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out_dir) + "-", dir=parent)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._floating: dict[torch.dtype, int] = {}  # elements written per floating dtype (config.json's dtype)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        if tensor.is_floating_point():
            self._floating[tensor.dtype] = self._floating.get(tensor.dtype, 0) + tensor.numel()
        owned = torch.empty(tensor.shape, dtype=tensor.dtype)  # a copy: streamed tensors may alias reused buffers
        self._pending[name] = owned.copy_(tensor.detach())
        self._pending_bytes += nbytes

    def _flush(self) -> None:
        n = len(self._shards)
        save_file(self._pending, os.path.join(self.tmp, f"shard-{n}.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def copy_side_files(self, src_dir: str) -> None:
        for name in SIDE_FILES:
            if os.path.isfile(os.path.join(src_dir, name)):
                shutil.copy2(os.path.join(src_dir, name), os.path.join(self.tmp, name))

    def _finish(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        total = len(self._shards)
        if total == 1:
            os.rename(os.path.join(self.tmp, "shard-0.safetensors"), os.path.join(self.tmp, SINGLE))
        else:
            weight_map, size = {}, 0
            for i, names in enumerate(self._shards):
                final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
                os.rename(os.path.join(self.tmp, f"shard-{i}.safetensors"), os.path.join(self.tmp, final))
                size += os.path.getsize(os.path.join(self.tmp, final))
                weight_map.update({n: final for n in names})
            with open(os.path.join(self.tmp, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": size}, "weight_map": weight_map}, f, indent=2)
        self._state_dtype()
        with open(os.path.join(self.tmp, WRITTEN_BY), "w") as f:
            json.dump({"written_by": self.tool, "files": sorted(os.listdir(self.tmp))}, f, indent=2)
        replace_dir(self.tmp, self.out_dir)

    def _state_dtype(self) -> None:
        """config.json states the dtype of the tensors written (the source's config said the source's:
        float32 over exported bfloat16 tensors): `dtype` (transformers >= 4.56) and `torch_dtype` (older
        readers, vLLM's config parsing); the dtype of most elements when several were written."""
        path = os.path.join(self.tmp, "config.json")
        if not self._floating or not os.path.isfile(path):
            return
        with open(path) as f:
            config = json.load(f)
        name = str(max(self._floating, key=self._floating.get)).removeprefix("torch.")
        config["dtype"] = config["torch_dtype"] = name
        if not any(dtype in fp8_blocks.FP8_DTYPES for dtype in self._floating):
            # An FP8 source's weights were dequantized on import: its quantization_config no longer holds.
            config.pop("quantization_config", None)
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self._finish()
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


def write_hf_dir(
    out_dir: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    side_files_from: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 1024**3,
) -> None:
    with HFDirWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite) as writer:
        for name, tensor in tensors:
            writer.add(name, tensor)
        if side_files_from:
            writer.copy_side_files(side_files_from)
