"""``torchrun --nproc-per-node P -m sarathi_pp.launch.torchrun --config ... [generate flags]``

One rank per pipeline stage (``sarathi_pp/executors/torchrun.py`` has the protocol). Rank 0
runs ``sarathi-pp generate`` with the torchrun executor: it hosts the scheduler and stage 0
and writes the outputs, exactly as ``sarathi-pp generate`` does; ranks 1..P-1 each run
one stage's loop (``PipelineStage.serve``) until rank 0 is done.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from sarathi_pp.cli import build_parser
from sarathi_pp.cli.common import (
    PROG,
    UsageError,
    config_from_args,
    sigterm_as_interrupt,
    user_errors,
)
from sarathi_pp.executors.torchrun import check_world_size, join_as_stage, resolve_stage


def main(argv: list[str] | None = None) -> int:
    """Same flags as ``sarathi-pp generate``; rank 0 prints and writes the outputs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(["generate", *argv, "--set", "parallel.executor=torchrun"])
    # torchrun stops every rank with SIGTERM when one fails: rank 0 then keeps what finished
    sigterm_as_interrupt()
    try:
        with user_errors():
            config = config_from_args(args)
            check_world_size(config)
        rank = int(os.environ["RANK"])
        if rank == 0:
            return args.func(args)
        with user_errors():  # the same model settings as rank 0's, checked the same way
            checkpoint, placement = resolve_stage(config)
        stage, control = join_as_stage(config, rank, checkpoint, placement)
        stage.serve(control)
        return 0
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
