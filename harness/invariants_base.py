"""What every invariant shares: the rules a run was configured with, the verdict each returns,
and the events that end an attempt."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from derivd.config import Config

# An attempt's own outcome, each fenced by its token: the row leaves `processing`.
ENDS_ATTEMPT = ("ready", "retry", "rejected", "released", "exhausted", "worker_died")
LOSSES = ("lease_lost", "worker_died")


@dataclass(frozen=True)
class Rules:
    """What the run was configured with."""

    max_attempts: int
    # slot (`name.format`) -> fingerprint (None: not compared), in configured order: the
    # first is the primary variant that derived_* describe.
    slots: Mapping[str, str | None]
    tenant_cap: int = 0  # [queue] max_in_flight_per_tenant (0: none)
    job_timeout: float = 0.0  # [supervisor] job_timeout (0: timeouts not measured)
    lease: float = 0.0  # [queue] lease (0: unknown)

    @classmethod
    def from_config(cls, config: Config) -> Rules:
        """The rules a derivd configuration sets: its cap, its variant set (with the
        fingerprint of the spec each slot is made by), its tenant cap, its job timeout
        and lease."""
        from derivd.fingerprint import configured_set

        return cls(
            max_attempts=config.queue.max_attempts,
            slots=configured_set(config.derive_spec(), config.derive.backend),
            tenant_cap=config.queue.max_in_flight_per_tenant,
            job_timeout=config.supervisor.job_timeout,
            lease=config.queue.lease,
        )


@dataclass
class Verdict:
    name: str
    checked: int
    unit: str
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self, limit: int = 4) -> str:
        text = f"{self.checked} {self.unit}"
        if self.violations:
            text += f"; {len(self.violations)} violation(s): " + "; ".join(self.violations[:limit])
        return text


def short(token: str | None) -> str:
    return token[:8] if token else "-"
