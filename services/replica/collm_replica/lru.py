"""Which adapter versions stay resident in the LoRA bank (pure: no torch, no asyncio).

A resident version occupies one slot. A slot is freed only when no request uses its version (refcount 0,
counting queued and running requests), so an in-flight request always finishes on the weights it started
with. When a slot is needed, the victim is the least recently used unreferenced version, preferring
versions that are no longer current for their adapter (superseded shadows) over current ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Resident:
    version_id: str
    name: str
    slot: int
    refs: int = 0
    last_used: int = 0
    current: bool = True


class VersionLru:
    def __init__(self, n_slots: int) -> None:
        if n_slots < 1:
            raise ValueError("n_slots must be >= 1")
        self.n_slots = n_slots
        self.by_id: dict[str, Resident] = {}
        self._tick = 0

    def _next(self) -> int:
        self._tick += 1
        return self._tick

    def __contains__(self, version_id: str) -> bool:
        return version_id in self.by_id

    def __len__(self) -> int:
        return len(self.by_id)

    def free_slot(self) -> int | None:
        used = {r.slot for r in self.by_id.values()}
        return next((s for s in range(self.n_slots) if s not in used), None)

    def victim(self) -> Resident | None:
        """The version to evict to make room, or None when every resident version is in use."""
        idle = [r for r in self.by_id.values() if r.refs == 0]
        if not idle:
            return None
        return min(idle, key=lambda r: (r.current, r.last_used))

    def slot_for_new(self) -> tuple[int, Resident | None] | None:
        """A slot for a new version: a free one, or (slot, victim to evict); None if all are in use."""
        free = self.free_slot()
        if free is not None:
            return free, None
        v = self.victim()
        return (v.slot, v) if v is not None else None

    def add(self, version_id: str, name: str, slot: int, current: bool = True) -> Resident:
        """Record a version written into `slot`; `current` makes it the one new requests of `name` get."""
        if version_id in self.by_id:
            raise ValueError(f"{version_id} is already resident")
        if any(r.slot == slot for r in self.by_id.values()):
            raise ValueError(f"slot {slot} is occupied")
        if current:
            for r in self.by_id.values():
                if r.name == name:
                    r.current = False
        res = Resident(version_id, name, slot, last_used=self._next(), current=current)
        self.by_id[version_id] = res
        return res

    def make_current(self, version_id: str) -> None:
        res = self.by_id[version_id]
        for r in self.by_id.values():
            if r.name == res.name:
                r.current = r.version_id == version_id

    def current_of(self, name: str) -> str | None:
        return next((r.version_id for r in self.by_id.values() if r.name == name and r.current), None)

    def clear_current(self, name: str) -> None:
        """No version of `name` is current any more (requests pinned to one still find it resident)."""
        for r in self.by_id.values():
            if r.name == name:
                r.current = False

    def evict(self, version_id: str) -> Resident:
        res = self.by_id[version_id]
        if res.refs:
            raise ValueError(f"{version_id} is in use by {res.refs} request(s)")
        return self.by_id.pop(version_id)

    def acquire(self, version_id: str) -> Resident:
        res = self.by_id[version_id]
        res.refs += 1
        res.last_used = self._next()
        return res

    def release(self, version_id: str) -> None:
        res = self.by_id.get(version_id)
        if res is None or res.refs <= 0:
            raise ValueError(f"{version_id} is not acquired")
        res.refs -= 1
