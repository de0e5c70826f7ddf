"""``python -m reasonkv.cli``: the same as ``reasonkv``."""

import sys

from reasonkv.cli.main import main

sys.exit(main())
