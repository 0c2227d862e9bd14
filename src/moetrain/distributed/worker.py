"""The torchrun entry point's old path: ``python -m moetrain.distributed.worker`` runs
``moetrain.cli.worker``. Kept for one release, like a renamed flag; start ``-m moetrain.cli.worker``."""

from __future__ import annotations

import sys

from moetrain.cli.worker import main

if __name__ == "__main__":
    sys.exit(main())
