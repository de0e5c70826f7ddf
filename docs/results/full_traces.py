"""Start a results file with another's full-cache traces, so that its fidelity replays reuse them.

Usage: full_traces.py SOURCE.jsonl NEW.jsonl

Copies SOURCE's manifests and its full cache's generation records (the greedy traces fidelity replays) into
NEW, which must not exist yet. ``reasonkv eval --fidelity-only --out NEW`` with the same setup (model, dtype,
token limit, prompt format) then replays those traces instead of generating them again; a run with another
setup is refused by the manifest check, as for any results file.
"""

import json
import sys
from pathlib import Path


def main(source: str, target: str) -> None:
    if Path(target).exists():
        sys.exit(f"{target} exists already: full_traces.py only starts a new results file")
    kept = []
    with open(source, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if record.get("kind") == "manifest" or (
                record.get("kind") == "generation" and record.get("policy") == "full"
            ):
                kept.append(line)
    with open(target, "x", encoding="utf-8") as out:
        out.writelines(kept)
    print(f"{target}: {len(kept)} records ({source}'s manifests and full-cache traces)")


if __name__ == "__main__":
    main(*sys.argv[1:])
