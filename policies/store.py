"""The worker's current policy: swapped atomically, reporting what changed."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from policies.bundle import CompiledBundle
from policies.model import PolicyDocument


@dataclass(frozen=True, slots=True)
class StoreUpdate:
    changed: bool
    previous_etag: str | None
    etag: str
    revision_before: str | None
    revision_after: str
    canary_before: str | None
    canary_after: str | None
    kill_switch_before: bool | None
    kill_switch_after: bool
    rules_added: tuple[str, ...] = ()
    rules_removed: tuple[str, ...] = ()
    rules_changed: tuple[str, ...] = ()
    engines_changed: tuple[str, ...] = ()

    def summary(self) -> str:
        if not self.changed:
            return f"unchanged ({self.etag[:12]})"
        parts = [f"revision {str(self.revision_before)[:12]} -> {self.revision_after[:12]}"]
        if self.canary_before != self.canary_after:
            parts.append(f"canary {str(self.canary_before)[:12]} -> {str(self.canary_after)[:12]}")
        if self.kill_switch_before != self.kill_switch_after:
            parts.append(f"kill switch {'on' if self.kill_switch_after else 'off'}")
        for label, names in (("added", self.rules_added), ("removed", self.rules_removed),
                             ("changed", self.rules_changed), ("engines changed", self.engines_changed)):
            if names:
                parts.append(f"rules {label}: {', '.join(names)}" if label != "engines changed"
                             else f"engines changed: {', '.join(names)}")
        return "; ".join(parts)


def _diff_documents(before: PolicyDocument | None, after: PolicyDocument
                    ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    old_rules = {r.name: r for r in before.rules} if before else {}
    new_rules = {r.name: r for r in after.rules}
    added = tuple(n for n in new_rules if n not in old_rules)
    removed = tuple(n for n in old_rules if n not in new_rules)
    changed = tuple(n for n in new_rules if n in old_rules and old_rules[n] != new_rules[n])
    old_engines = before.engines if before else {}
    engines = tuple(sorted(n for n in set(old_engines) | set(after.engines)
                           if old_engines.get(n) != after.engines.get(n)))
    return added, removed, changed, engines


class PolicyStore:
    """Holds the compiled bundle in use.

    Readers take ``store.current`` without a lock: replacing one attribute is
    atomic in Python, so a request sees either the old bundle or the new one,
    never a mix. The lock only orders writers, so two updates racing cannot
    report changes against the wrong predecessor.
    """

    def __init__(self, initial: CompiledBundle | None = None) -> None:
        self._lock = threading.Lock()
        self.current: CompiledBundle | None = initial

    def update(self, bundle: CompiledBundle) -> StoreUpdate:
        with self._lock:
            before = self.current
            if before is not None and before.etag == bundle.etag:
                return StoreUpdate(False, before.etag, bundle.etag, before.active.revision,
                                   bundle.active.revision, _canary_rev(before), _canary_rev(bundle),
                                   before.kill_switch, bundle.kill_switch)
            added, removed, changed, engines = _diff_documents(
                before.active.document if before else None, bundle.active.document)
            self.current = bundle
            return StoreUpdate(
                True,
                before.etag if before else None, bundle.etag,
                before.active.revision if before else None, bundle.active.revision,
                _canary_rev(before) if before else None, _canary_rev(bundle),
                before.kill_switch if before else None, bundle.kill_switch,
                added, removed, changed, engines,
            )


def _canary_rev(bundle: CompiledBundle | None) -> str | None:
    if bundle is None or bundle.canary is None:
        return None
    return bundle.canary.revision
