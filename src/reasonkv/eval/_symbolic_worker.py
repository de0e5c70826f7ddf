"""Child process that answers math-verify equivalence queries.

Protocol: one JSON object per line on stdin, ``{"pred": str, "gold": str, "timeout": int}``;
one line ``{"ok": bool}`` back per query on the original stdout. The first line written is
``ready`` once the imports are done. The process exits at end of input.

It runs as a plain script (no reasonkv import), so it works wherever the parent's interpreter
can import math_verify.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def main() -> None:
    # Keep the protocol channel private: anything the libraries print goes to stderr instead.
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException  # a BaseException, so named explicitly

    # Its per-call timeouts (signal based: this is the main thread of its own process) end most
    # slow comparisons quietly; the parent's wall-clock limit catches the rest.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    channel.write("ready\n")
    for line in sys.stdin:
        ok = False
        try:
            query = json.loads(line)
            seconds = int(query.get("timeout", 5))
            gold = parse(query["gold"], extraction_config=configs, parsing_timeout=seconds)
            pred = parse(query["pred"], extraction_config=configs, parsing_timeout=seconds)
            ok = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=seconds))
        except (Exception, TimeoutException):  # a bad query, sympy failure or timeout: not equivalent
            ok = False
        channel.write(json.dumps({"ok": ok}) + "\n")


if __name__ == "__main__":
    main()
