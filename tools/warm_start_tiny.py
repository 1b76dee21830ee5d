"""Build a built-in warm-started tiny model (see remax_megatron/builtin/models.py) and print its metrics.

    python tools/warm_start_tiny.py --name tiny-arith --out /tmp/tiny-arith
    python tools/warm_start_tiny.py --name tiny-arith-rm --out /tmp/tiny-arith-rm
    python tools/warm_start_tiny.py --name all            # into the cache the trainer uses (builtin:<name>)

--out writes a standalone copy (the same bytes the cache would hold); without
it the model goes to $REMAX_CACHE or ~/.cache/remax_megatron, where
`actor.model=builtin:tiny-arith` finds it. Metrics are on the held-out eval
prompts: for the actor, greedy exact match and the exact probability of the
correct answer (= expected temperature-1 sampled accuracy); for the reward
model, mean scores of correct vs wrong answers and their gap.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    from remax_megatron.builtin import models as bm

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, choices=[*bm.RECIPES, "all"])
    p.add_argument("--out", default=None, help="standalone output directory (default: the cache)")
    p.add_argument("--cache-dir", default=None, help="cache root (default: $REMAX_CACHE or ~/.cache/remax_megatron)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    a = p.parse_args(argv)
    names = list(bm.RECIPES) if a.name == "all" else [a.name]
    if a.out and len(names) > 1:
        sys.exit("error: --out takes one --name; use --cache-dir for all")
    for name in names:
        t = time.time()
        if a.out:
            if os.path.exists(a.out) and not a.overwrite:
                sys.exit(f"error: {a.out} exists: choose a new --out or pass --overwrite")
            parent = os.path.dirname(os.path.abspath(a.out))
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=parent, prefix=".warm_start_tiny-")
            try:
                bm.build_model(name, tmp)
                if os.path.exists(a.out):
                    shutil.rmtree(a.out)
                os.rename(tmp, a.out)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            path = a.out
        else:
            path = bm.ensure_builtin_model(name, a.cache_dir)
        info = bm.read_build_info(path)
        print(
            json.dumps(
                dict(
                    name=name,
                    path=path,
                    seconds=round(time.time() - t, 1),
                    build_seconds=info["build_seconds"],
                    metrics=info["metrics"],
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
