"""``python -m shardline.cli ...`` runs the ``shardline`` command (as torchrun's ``-m`` does on every node)."""

import sys

from shardline.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
