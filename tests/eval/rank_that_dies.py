"""``reasonkv`` as torchrun starts it, except that rank ``DIE_RANK`` kills itself (SIGKILL) after writing
``DIE_AFTER`` records: a rank that crashes mid-run, for the kill-and-resume tests."""

import os
import signal
import sys

from reasonkv.cli import main
from reasonkv.eval.records import ResultsFile

if os.environ.get("RANK") == os.environ.get("DIE_RANK"):
    append = ResultsFile.append
    written = []

    def append_then_die(self, record):
        append(self, record)
        written.append(record)
        if len(written) == int(os.environ["DIE_AFTER"]):
            os.kill(os.getpid(), signal.SIGKILL)

    ResultsFile.append = append_then_die

if __name__ == "__main__":
    sys.exit(main())
