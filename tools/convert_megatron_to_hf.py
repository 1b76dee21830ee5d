"""Export a megatron checkpoint to a Hugging Face directory, through the same export
path the rollout weight sync uses (TP shards gathered, PP stages broadcast).

    python tools/convert_megatron_to_hf.py --ckpt CKPT --out HF --tp 1 --pp 1
    torchrun --nproc_per_node=4 tools/convert_megatron_to_hf.py --ckpt CKPT --out HF --tp 2 --pp 2
    torchrun --nproc_per_node=2 tools/convert_megatron_to_hf.py --ckpt MOE_CKPT --out HF --ep 2

CKPT is a model checkpoint (tools/convert_hf_to_megatron.py) or a training
checkpoint (its actor; a LoRA actor's adapters are merged: W + (alpha/r) B A in fp32, then cast).
--peft (a LoRA checkpoint): writes the adapters alone as a PEFT adapter directory instead
(adapter_config.json + adapter_model.safetensors; weights/peft_export.py), which
`peft.PeftModel.from_pretrained(base_hf_model, OUT)` loads onto the base model.
The world size must hold the layout: tp * pp, times what expert parallelism
needs beyond tp (--ep 2 at --tp 1: 2 processes; --tp 2 --ep 2: 2 with whole experts, --etp 1, or 4
with --etp 2), or a multiple of that (the extra data-parallel replicas export the same tensors). An existing
--out (a file or a non-empty directory) is refused; --overwrite replaces only an HF directory this tool wrote (its
remax_written_by.json lists the files) and says what it removes. Errors are one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remax_megatron.console import quiet_console  # noqa: E402

TOOL = "convert_megatron_to_hf"  # recorded in the HF directory it writes (what --overwrite may replace)


def convert(
    ckpt: str,
    out: str,
    tp: int = 1,
    pp: int = 1,
    dtype: str | None = None,
    overwrite: bool = False,
    ep: int = 1,
    etp: int = 0,
    peft: bool = False,
) -> str:
    import torch.distributed as dist

    from remax_megatron.models.arch import DTYPES, ExpertOptions
    from remax_megatron.models.hf_config import check_layout
    from remax_megatron.parallel import ParallelLayout, init_distributed
    from remax_megatron.weights.export import save_hf_dir
    from remax_megatron.weights.hf_io import check_out_dir, hf_dir_entries
    from remax_megatron.weights.megatron_ckpt import (
        build_model_for,
        load_model,
        read_checkpoint_lora,
        read_checkpoint_meta,
    )

    out = os.path.abspath(out)
    replacing = check_out_dir(out, overwrite, lambda path: hf_dir_entries(path, TOOL), "a Hugging Face directory")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    arch, params_dtype = read_checkpoint_meta(ckpt)
    lora = read_checkpoint_lora(ckpt)
    if peft and lora is None:
        raise ValueError(
            f"--peft: {ckpt} holds no LoRA adapters (it was not trained with actor.lora_rank > 0): "
            "drop --peft to export its weights"
        )
    if peft and (overwrite or dtype):
        raise ValueError("--peft writes the adapters as trained: --dtype and --overwrite do not apply to it")
    check_layout(arch, tp, pp, what="--", ep=ep)
    needed = ParallelLayout.smallest_world(tp, pp, ep, etp)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; checked before any process group exists
    if world % needed:
        layout = f"tp({tp}) * pp({pp})" + (f" with ep({ep}) * etp({etp or tp})" if ep > 1 else "")
        raise ValueError(
            f"world size {world} but {layout} needs {needed} processes (or a multiple): launch with "
            f"torchrun --nproc_per_node={needed}"
        )
    init_distributed()
    ParallelLayout(tp=tp, pp=pp, world_size=world, ep=ep, etp=etp).initialize()
    model = build_model_for(
        arch,
        tp=tp,
        pp=pp,
        params_dtype=params_dtype,
        init_weights=False,
        experts=ExpertOptions(ep=ep, etp=etp or tp),
        lora=lora,
    )
    load_model(model, ckpt)  # a LoRA checkpoint's adapters too: the export writes W + (alpha/r) B A
    if peft:
        from remax_megatron.weights.peft_export import write_peft_dir

        write_peft_dir(model, out, base_model=os.path.join(ckpt, "hf_config"))
        dist.barrier()
        return out
    save_hf_dir(
        model,
        out,
        os.path.join(ckpt, "hf_config"),
        tool=TOOL,
        writer=dist.get_rank() == 0,
        dtype=DTYPES[dtype] if dtype else None,
        overwrite=overwrite,
    )
    if replacing and dist.get_rank() == 0:
        print(replacing, flush=True)
    dist.barrier()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="model or training checkpoint directory")
    p.add_argument("--out", required=True, help="Hugging Face directory to create")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="MoE: expert parallel")
    p.add_argument("--etp", type=int, default=0, help="MoE: expert tensor parallel, 1 or --tp (default: --tp)")
    p.add_argument("--dtype", default=None, help="cast to float32 | bfloat16 | float16 (default: as saved)")
    p.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA checkpoint: write its adapters as a PEFT adapter directory (not merged weights)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an HF directory this tool wrote before at --out (nothing else)",
    )
    a = p.parse_args(argv)
    quiet_console()  # the libraries' warnings and progress bars, as in a training run
    try:
        out = convert(a.ckpt, a.out, a.tp, a.pp, a.dtype, a.overwrite, a.ep, a.etp, a.peft)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
