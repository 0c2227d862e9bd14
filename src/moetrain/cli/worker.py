"""What torchrun starts on every rank of ``moetrain train``: ``python -m moetrain.cli.worker``.

It takes ``moetrain train``'s flags (or the spec file the launcher names in ``MOETRAIN_RUN_SPEC``), so
both entries build and check the spec alike, then runs the rank (``moetrain.train.rank``).
"""

from __future__ import annotations

import sys

from moetrain.cli.train import worker_main


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main())
