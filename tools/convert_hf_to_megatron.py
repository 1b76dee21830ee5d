"""Convert a Hugging Face safetensors directory into a megatron distributed checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir HF --out CKPT
    torchrun --nproc_per_node=4 tools/convert_hf_to_megatron.py --hf-dir HF --out CKPT --tp 2 --pp 2
    torchrun --nproc_per_node=2 tools/convert_hf_to_megatron.py --hf-dir MOE --out CKPT --ep 2   # MoE experts split

The checkpoint is layout-free: any TP/PP loads it (tools/convert_megatron_to_hf.py,
the trainer). Under torchrun each rank reads only its own slices of the HF
tensors, which splits the work. Nothing is written unless the whole conversion
succeeds. An existing --out (a file or a non-empty directory) is refused; --overwrite
replaces only a model checkpoint this tool wrote (model/, hf_config/, remax_checkpoint.json and
nothing else) and says what it removes. Errors are one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remax_megatron.console import quiet_console  # noqa: E402


def convert(hf_dir: str, out: str, tp: int = 1, pp: int = 1, overwrite: bool = False, ep: int = 1, etp: int = 0) -> str:
    import torch.distributed as dist

    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.models.families import family_named
    from remax_megatron.models.hf_config import check_layout, read_hf_config
    from remax_megatron.parallel import ParallelLayout, init_distributed
    from remax_megatron.weights import HFCheckpointReader, load_hf_weights
    from remax_megatron.weights.hf_io import check_out_dir, replace_dir
    from remax_megatron.weights.megatron_ckpt import build_model_for, model_checkpoint_entries, save_model

    out = os.path.abspath(out)
    replacing = check_out_dir(out, overwrite, model_checkpoint_entries, "a model checkpoint")
    arch = read_hf_config(hf_dir)
    check_layout(arch, tp, pp, what="--", ep=ep)
    reader = HFCheckpointReader(hf_dir)  # opens and checks every file before any work
    _, world = init_distributed()
    ParallelLayout(tp=tp, pp=pp, world_size=world, ep=ep, etp=etp).initialize()
    dtype = reader.dtype(family_named(arch.family).hf_embedding)
    model = build_model_for(
        arch, tp=tp, pp=pp, params_dtype=dtype, init_weights=False, experts=ExpertOptions(ep=ep, etp=etp or tp)
    )
    load_hf_weights(model, reader)

    # Every rank writes into one temporary directory that rank 0 created.
    tmp = [
        tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out) + "-", dir=os.path.dirname(out) or ".")
        if dist.get_rank() == 0
        else None
    ]
    dist.broadcast_object_list(tmp, src=0)
    try:
        save_model(model, tmp[0], hf_dir)
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)
        raise
    if dist.get_rank() == 0:
        if replacing:
            print(replacing, flush=True)
        replace_dir(tmp[0], out)
    dist.barrier()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="checkpoint directory to create")
    p.add_argument("--tp", type=int, default=1, help="TP used to split the work (the result is layout-free)")
    p.add_argument("--pp", type=int, default=1, help="PP used to split the work")
    p.add_argument("--ep", type=int, default=1, help="MoE: expert parallel used to split the work")
    p.add_argument("--etp", type=int, default=0, help="MoE: expert tensor parallel, 1 or --tp (default: --tp)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a model checkpoint this tool wrote before at --out (nothing else)",
    )
    a = p.parse_args(argv)
    quiet_console()  # the libraries' warnings and progress bars, as in a training run
    try:
        out = convert(a.hf_dir, a.out, a.tp, a.pp, a.overwrite, a.ep, a.etp)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
