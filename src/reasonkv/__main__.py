"""``python -m reasonkv``: the command line (what ``torchrun -m reasonkv`` starts in every process)."""

import sys

from reasonkv.cli import main

if __name__ == "__main__":
    sys.exit(main())
