"""``reasonkv`` as a user starts it, except that right after the ``FAULT_AFTER``-th record is written, the
shell command ``FAULT`` runs (and this process waits for it): a folder removed or renamed, a disk filled, in
the middle of a real run. With ``FAULT_RANK`` only that rank of a launcher does it."""

import os
import subprocess
import sys

from reasonkv.cli import main
from reasonkv.eval.records import ResultsFile

if "FAULT" in os.environ and os.environ.get("FAULT_RANK", os.environ.get("RANK")) == os.environ.get("RANK"):
    append = ResultsFile.append
    written = []

    def append_then_fault(self, record):
        append(self, record)
        written.append(record)
        if len(written) == int(os.environ["FAULT_AFTER"]):
            subprocess.run(os.environ["FAULT"], shell=True, check=True)

    ResultsFile.append = append_then_fault

if __name__ == "__main__":
    sys.exit(main())
