"""The run manifest: what the records of a results file were computed with, to reproduce and compare them.

A manifest (``"kind": "manifest"``) is the first line of every results file and shard file; a later run
into the same file appends its own when it differs. Its ``setup`` must match (else the run is refused, naming
what differs), its ``environment`` may differ (a warning), its ``grid`` holds the grid's identity
(:func:`grid_identity`), and its ``id`` must match its content (:func:`manifest_problem`). Every field:
docs/records.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from reasonkv.runs.digest import file_sha256

__all__ = [
    "SETUP_FIELDS",
    "build_manifest",
    "check_compatible",
    "describe",
    "differences",
    "file_sha256",
    "git_commit",
    "grid_differences",
    "grid_identity",
    "grid_sha256",
    "manifest_id",
    "manifest_problem",
    "shown",
    "tokenizer_sha256",
]

#: The setup fields that also decide a grid's units and their cost (so its split across processes).
GRID_SETUP_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
_MODEL_FIELDS = ("model", "model_revision", "weights_sha256", "tokenizer_sha256", "dtype", "attn_implementation")
SETUP_FIELDS = (*_MODEL_FIELDS, "prompt_format", *GRID_SETUP_FIELDS)


def tokenizer_sha256(tokenizer) -> str:
    """SHA-256 of what turns a problem into prompt tokens: class, vocabulary, special tokens, chat template."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = sorted(get_vocab().items()) if callable(get_vocab) else None
    facts = {
        "class": type(tokenizer).__name__,
        "vocab": vocab,
        "special": {
            name: str(getattr(tokenizer, name, None)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        },
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return _sha256(facts)


def git_commit() -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the reasonkv sources when they are tracked in a git checkout, else ``(None, None)``."""
    package = Path(__file__).resolve().parent.parent
    try:

        def git(*args: str) -> str:
            done = subprocess.run(
                ["git", "-C", str(package), *args], capture_output=True, text=True, timeout=10, check=True
            )
            return done.stdout.strip()

        git("ls-files", "--error-unmatch", "__init__.py")  # the package itself is in this repository
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "."))
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, dirty


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def manifest_id(manifest: Mapping[str, Any]) -> str:
    return _sha256({k: manifest.get(k) for k in ("setup", "environment", "grid")})[:16]


def grid_identity(grid: Mapping[str, Any], setup: Mapping[str, Any]) -> dict[str, Any]:
    """What decides a grid's units and their split across processes, from a manifest's ``grid`` and ``setup``.

    Datasets (name, file hash, limit, samples), cells (label, budget, buffer, config), fidelity, its
    length, generation on or off, and the decoding settings that decide sample counts and costs. Not
    the batch size, the file paths or the model: the same grid may be resumed with other batches, and
    the setup is compared on its own (:func:`check_compatible`).
    """
    return {
        "datasets": [{k: d.get(k) for k in ("name", "sha256", "limit", "samples")} for d in grid.get("datasets", [])],
        "policies": [{k: p.get(k) for k in ("label", "budget", "buffer", "config")} for p in grid.get("policies", [])],
        "fidelity": grid.get("fidelity"),
        "fidelity_tokens": grid.get("fidelity_tokens") if grid.get("fidelity") else None,
        "generation": grid.get("generation", True),
        **{k: setup.get(k) for k in GRID_SETUP_FIELDS},
    }


def grid_sha256(identity: Mapping[str, Any]) -> str:
    return _sha256(identity)


def _cell(policy: Mapping[str, Any]) -> str:
    return str(policy.get("label", "?")) + ("" if policy.get("budget") is None else f"@{policy.get('budget')}")


def _dataset(dataset: Mapping[str, Any]) -> str:
    limit = dataset.get("limit") or "all"
    return f"{dataset.get('name')}:{limit} x{dataset.get('samples')} (sha256 {str(dataset.get('sha256'))[:12]}...)"


def grid_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What differs between two :func:`grid_identity` dicts, in words (``policies: [a] there, [b] now``)."""
    found = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key):
            continue
        if key in ("policies", "datasets"):
            show = _cell if key == "policies" else _dataset
            there, now = (", ".join(map(show, grid.get(key) or [])) for grid in (old, new))
            found.append(f"{key}: [{there}] there, [{now}] now" if there != now else f"{key}: their options differ")
        else:
            found += differences(old, new, [key])
    return found


def shown(value: Any, most: int = 40, *, sort_keys: bool = False) -> str:
    """``value`` as JSON for a message, cut to ``most`` characters."""
    text = json.dumps(value, default=str, sort_keys=sort_keys)
    return text if len(text) <= most else text[: most - 3] + "..."


_SETUP_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "dtype": (str,),
    "prompt_format": (str,),
    "max_new_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "seed": (int,),
}


def manifest_problem(manifest: Mapping[str, Any]) -> str | None:
    """What is wrong with a manifest read from a file (a hand edit), in words; None when it is sound.

    Its sections must be objects, the fields reasonkv reads must have their types, and its ``id`` must
    match its content (:func:`manifest_id`): a manifest edited after it was written no longer says what
    the records after it were computed with.
    """
    if not isinstance(manifest.get("id"), str) or not manifest.get("id"):
        return f"the manifest's field 'id' must be a non-empty string, got {shown(manifest.get('id'))}"
    for name in ("setup", "environment", "grid"):
        if not isinstance(manifest.get(name), dict):
            return f"the manifest's field '{name}' must be an object, got {shown(manifest.get(name))}"
    for name, types in _SETUP_TYPES.items():
        value = manifest["setup"].get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            return f"the manifest's field 'setup.{name}' has the wrong type: {shown(value)}"
    grid = manifest["grid"]
    for name, needed in (("datasets", "name"), ("policies", "label")):
        items = grid.get(name, [])
        if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get(needed), str) for i in items
        ):
            return f"the manifest's field 'grid.{name}' must be a list of objects with a '{needed}', got {shown(items)}"
    launch = manifest.get("launch", {})
    if not isinstance(launch, dict) or not isinstance(launch.get("world_size", 1), int):
        return f"the manifest's field 'launch' must be an object with an integer 'world_size', got {shown(launch)}"
    command = manifest.get("command")
    if command is not None and not (isinstance(command, list) and all(isinstance(c, str) for c in command)):
        return f"the manifest's field 'command' must be a list of strings or null, got {shown(command)}"
    if manifest_id(manifest) != manifest["id"]:
        return (
            f"the manifest's id {manifest['id']} does not match its content (its setup, environment or grid was "
            "edited after it was written, so it no longer says what the records after it were computed with)"
        )
    return None


def build_manifest(
    *,
    setup: Mapping[str, Any],
    environment: Mapping[str, Any],
    grid: Mapping[str, Any],
    command: Sequence[str] | None,
    world_size: int,
    code: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest record of a run (``setup`` holds :data:`SETUP_FIELDS`; ``grid`` as :mod:`~reasonkv.eval.plan`
    describes it)."""
    missing = [k for k in SETUP_FIELDS if k not in setup]
    if missing:
        raise ValueError(f"manifest setup lacks {', '.join(missing)}")
    manifest: dict[str, Any] = {
        "kind": "manifest",
        "tool": "reasonkv",
        "format": 2,
        "id": "",
        "setup": {k: setup[k] for k in SETUP_FIELDS},
        "environment": dict(environment),
        "grid": {**dict(grid), **({} if code is None else {"code": dict(code)})},
        "command": None if command is None else list(command),
        "launch": {"world_size": world_size},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    manifest = json.loads(json.dumps(manifest, default=str))  # as it will be read back
    manifest["id"] = manifest_id(manifest)
    return manifest


def differences(old: Mapping[str, Any], new: Mapping[str, Any], fields: Sequence[str]) -> list[str]:
    """``key: old there, new now`` for each of ``fields`` whose values differ."""
    return [f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in fields if old.get(k) != new.get(k)]


def check_compatible(
    path: str | os.PathLike[str], manifests: Sequence[Mapping[str, Any]], new: Mapping[str, Any]
) -> list[str]:
    """Refuse ``new`` for a file holding ``manifests`` when its setup or a dataset file differs.

    Returns the environment differences from the file's latest manifest (for a warning).
    """
    first = manifests[0]
    problems = differences(first["setup"], new["setup"], SETUP_FIELDS)
    hashes = {d.get("name"): d.get("sha256") for m in manifests for d in m["grid"].get("datasets", [])}
    for dataset in new["grid"]["datasets"]:
        old = hashes.get(dataset["name"])
        if old is not None and old != dataset["sha256"]:
            problems.append(f"dataset {dataset['name']} sha256: {old[:12]}... there, {dataset['sha256'][:12]}... now")
    if problems:
        raise ValueError(
            f"{path} holds results of another setup ({'; '.join(problems)}): results of two setups never share "
            "a file; use another --out, or the same settings to resume"
        )
    latest = manifests[-1]["environment"]
    return differences(latest, new["environment"], sorted(set(latest) | set(new["environment"])))


def describe(manifest: Mapping[str, Any]) -> list[str]:
    """A sound manifest (:func:`manifest_problem`) as markdown bullet lines (for ``reasonkv report``)."""
    setup, env, grid = manifest["setup"], manifest["environment"], manifest["grid"]

    def short(value: Any) -> str:
        return "—" if value is None else str(value)[:12]

    git = short(env.get("git_commit")) + (" (uncommitted changes)" if env.get("git_dirty") else "")
    revision = f", revision {setup['model_revision']}" if setup.get("model_revision") else ""
    sampling = f"temperature {setup.get('temperature')}, top-p {setup.get('top_p')}, top-k {setup.get('top_k')}"
    datasets = ", ".join(
        f"{d.get('name')} ({d.get('problems')} problems x {d.get('samples')} "
        f"sample{'' if d.get('samples') == 1 else 's'}, sha256 {short(d.get('sha256'))})"
        for d in grid.get("datasets", [])
    )
    policies = ", ".join(_cell(p) for p in grid.get("policies", []))
    command = manifest.get("command")
    world = manifest.get("launch", {}).get("world_size", 1)
    lines = [
        f"- run `{manifest.get('id')}`, {manifest.get('created')}" + (f", {world} processes" if world > 1 else ""),
        f"  - model {setup.get('model')}{revision}, weights sha256 {short(setup.get('weights_sha256'))}, "
        f"tokenizer sha256 {short(setup.get('tokenizer_sha256'))}, {setup.get('dtype')}, "
        f"attention {setup.get('attn_implementation')}, prompt {setup.get('prompt_format')}",
        f"  - decoding: max {setup.get('max_new_tokens')} new tokens, {sampling}, seed {setup.get('seed')}",
        f"  - datasets: {datasets}",
        f"  - policies: {policies}; fidelity {'on' if grid.get('fidelity') else 'off'}",
        f"  - reasonkv {env.get('reasonkv')} (git {git}), torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}, python {env.get('python')}, {env.get('device_name')}",
    ]
    code = grid.get("code")
    if isinstance(code, dict) and code:
        lines.append(
            f"  - code: tests of {code.get('timeout')} s and {code.get('memory_mb')} MiB each, {code.get('workers')} "
            f"at once; sandbox {code.get('mechanism')} ({', '.join(code.get('isolation') or []) or 'no isolation'})"
            + (f"; missing, allowed: {', '.join(code['missing'])}" if code.get("missing") else "")
        )
    if command:
        lines.append(f"  - command: `{shlex.join(command)}`")
    return lines
