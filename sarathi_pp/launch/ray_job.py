"""Entry point for ``ray job submit --working-dir . -- python -m sarathi_pp.launch.ray_job
--config configs/tiny-llama-pp2.yaml [generate flags]``.

Inside a Ray job ``RAY_ADDRESS`` points at the cluster, so the Ray executor connects to it
instead of starting a local Ray; otherwise this is ``sarathi-pp generate``, flag for flag,
with the stages forced onto Ray actors.
"""

from __future__ import annotations

import sys

from sarathi_pp.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return cli_main(["generate", *argv, "--set", "parallel.executor=ray"])


if __name__ == "__main__":
    sys.exit(main())
