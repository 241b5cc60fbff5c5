"""The invariants of the bucket: every object owned by a row, every referenced object present."""

from __future__ import annotations

from harness.history import History
from harness.invariants_base import Rules, Verdict

# --------------------------------------------------------------------------- objects


def objects_owned(history: History, rules: Rules) -> Verdict:
    """Every stored object (each version of each key) is an original or a variant of a
    row that is not deleted, in the write-ahead registry, or retired for deletion."""
    verdict = Verdict("every stored object has an owner", 0, "object versions")
    referenced = _referenced(history)
    referenced_keys = {key for key, _ in referenced}
    for obj in history.objects:
        verdict.checked += 1
        if (obj.key, obj.version) in referenced:
            continue
        if _registered(obj.key, history.pending_keys | history.retired_keys):
            continue
        why = (
            "another version of the key is referenced"
            if obj.key in referenced_keys
            else ("referenced by no row or variant")
        )
        verdict.violations.append(
            f"{obj.key} version {obj.version}: {why}, not in pending_objects, not retired"
        )
    return verdict


def objects_present(history: History, rules: Rules) -> Verdict:
    """Every variant and original a row still references is in the store, by version."""
    verdict = Verdict("every referenced object is stored", 0, "references")
    stored = {(o.key, o.version) for o in history.objects}
    for key, version in sorted(_referenced(history)):
        verdict.checked += 1
        if (key, version) not in stored:
            verdict.violations.append(f"{key} version {version}: referenced, not stored")
    return verdict


def _registered(key: str, registry: set[str]) -> bool:
    """`key` is in the registry, itself or under a registered prefix (`…/`)."""
    if key in registry:
        return True
    parts = key.split("/")
    return any("/".join(parts[:n]) + "/" in registry for n in range(1, len(parts)))


def _referenced(history: History) -> set[tuple[str, str]]:
    """(key, version) of every original and variant of a row not deleted. An original
    rejected as missing_original is referenced by nothing (it never was there)."""
    out: set[tuple[str, str]] = set()
    for row in history.rows.values():
        if row.status == "deleted" or row.rederive_of is not None:
            continue
        if row.original_version is not None and row.error_code != "missing_original":
            out.add((row.original_key, row.original_version))
    for variant in history.variants:
        owner = history.rows.get(variant.file_id)
        if owner is not None and owner.status != "deleted":
            out.add((variant.key, variant.version))
    return out
