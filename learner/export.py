"""``turnscale export <checkpoint> <dir>``: a learner checkpoint as an HF model folder.

Works for both strategies' checkpoints (``learner.checkpoint``): a sharded one
(``learner.strategy=fsdp``) is gathered from its shards in this one process (DCP reshards
onto one full copy, no torch.distributed), a replicated one is copied from its ``model/``.
The folder holds safetensors weights, ``config.json`` and the tokenizer files: what
``turnscale eval``, actors (``model.path``) and ``transformers`` load.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from turnscale.protocol.dtypes import FLOAT_DTYPES


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="turnscale export", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("checkpoint", help="a checkpoint folder (<learner.dir>/checkpoints/step-N), or a checkpoints/ "
                                      "folder (its newest complete checkpoint)")
    p.add_argument("out", help="the HF model folder to write")
    p.add_argument("--dtype", default="float32", choices=FLOAT_DTYPES, help="dtype of the written weights")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    from turnscale.learner import checkpoint

    path = args.checkpoint
    if not os.path.isfile(os.path.join(path, "meta.json")):
        path = checkpoint.latest(path) or path
    try:
        checkpoint.export_hf(path, args.out, dtype=args.dtype)
    except (checkpoint.CheckpointError, OSError) as exc:
        print(f"turnscale export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {path} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
