"""Compare two eval results files (plain or .gz) record by record, ignoring timing, run ids and memory."""

import gzip
import json
import sys

VOLATILE = {
    "time", "seconds", "run", "prefill_seconds", "decode_seconds", "tokens_per_second", "peak_memory_bytes",
    "policy_seconds", "reasonkv_version",
}  # fmt: skip


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    out = {}
    with opener(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            r = json.loads(line)
            if r.get("kind") == "manifest":
                continue
            key = (r["kind"], r["dataset"], r["problem_id"], r["policy_label"], r.get("budget"), r.get("sample"))
            out[key] = {k: v for k, v in r.items() if k not in VOLATILE}
    return out


a, b = load(sys.argv[1]), load(sys.argv[2])
print(f"records: {len(a)} vs {len(b)}; keys only in one: {len(set(a) ^ set(b))}")
same = diff = 0
fields: dict = {}
for key in sorted(set(a) & set(b), key=str):
    if a[key] == b[key]:
        same += 1
        continue
    diff += 1
    for f in set(a[key]) | set(b[key]):
        if a[key].get(f) != b[key].get(f):
            fields.setdefault(f, []).append(key)
print(f"identical: {same}, different: {diff}")
for f, keys in sorted(fields.items()):
    print(f"  field {f}: {len(keys)} records, e.g. {keys[0]}: {a[keys[0]].get(f)!r} vs {b[keys[0]].get(f)!r}"[:400])
sys.exit(1 if diff or set(a) ^ set(b) else 0)
