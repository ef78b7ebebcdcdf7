"""Outlier detection of one backend: active probes and failing requests, driven by `(now, event)`.

A backend leaves after `health.unhealthy_after` failed probes in a row and comes back after
`healthy_after` good ones. Requests failing `eject_after` times in a row eject it for
`ejection_seconds`, doubling (up to `max_ejection_seconds`) each time it is ejected again
before a success; while ejected, probes are not heard, and once its time is over it returns
after `healthy_after` good probes (logged as a return from ejection). Nothing here reads a clock or does I/O:
the health checker and the forwarding stage report events with the time they happened.
"""

from __future__ import annotations

import logging

from router.config import Health

# One line each time a backend is taken out or comes back, with why.
state_log = logging.getLogger("specroute.backends")


class Outlier:
    def __init__(self, name: str, pool: str, *, healthy: bool = True) -> None:
        """`healthy=False`: out until its first health check passes (a backend found by name)."""
        self._names = (name, pool)
        self.config = Health()  # the `health` section, replaced on a reload (router.backends)
        self.healthy = healthy
        self._probes_failed = self._probes_passed = 0  # in a row
        self._requests_failed = 0  # in a row
        self.ejections = 0  # in a row, without a success between
        self.ejected_for = 0.0  # seconds, the latest ejection
        self.ejected_until = 0.0
        # Out because it was ejected (until it returns), and whether its probes failed since.
        self._back_from_ejection = self._failed_after_ejection = False

    def probed(self, now: float, ok: bool, *, first: bool = False) -> None:
        """An active health check's result; `first` (at start-up) decides at once."""
        if now < self.ejected_until:
            return  # ejected backends sit out their time whatever the probes say
        config = self.config
        if ok:
            self._probes_failed, self._probes_passed = 0, self._probes_passed + 1
            if not self.healthy and (first or self._probes_passed >= config.healthy_after):
                self.healthy = True
                if self._back_from_ejection:
                    self._back_from_ejection = self._failed_after_ejection = False
                    state_log.info(
                        "backend %s (pool %s) returned after ejection (%g s): %d health checks passed",
                        *self._names,
                        self.ejected_for,
                        self._probes_passed,
                    )
                else:
                    state_log.info(
                        "backend %s (pool %s) healthy: %d health checks passed", *self._names, self._probes_passed
                    )
        else:
            self._probes_failed, self._probes_passed = self._probes_failed + 1, 0
            if first or self._probes_failed >= config.unhealthy_after:
                if self.healthy:
                    self.healthy = False
                    state_log.warning(
                        "backend %s (pool %s) unhealthy: %d health checks failed", *self._names, self._probes_failed
                    )
                elif self._back_from_ejection and not self._failed_after_ejection:
                    # Its ejection time is over and the engine still fails: once, not every probe.
                    self._failed_after_ejection = True
                    state_log.warning(
                        "backend %s (pool %s) still unhealthy after its ejection: %d health checks failed",
                        *self._names,
                        self._probes_failed,
                    )

    def request_failed(self, now: float) -> bool:
        """A request failed on this backend; returns True if that ejected it."""
        config = self.config
        self._requests_failed += 1
        if self._requests_failed < config.eject_after or not self.healthy:
            return False
        self.ejections += 1
        self.ejected_for = min(config.max_ejection_seconds, config.ejection_seconds * 2 ** (self.ejections - 1))
        self.ejected_until = now + self.ejected_for
        self.healthy = False
        self._back_from_ejection = True
        state_log.warning(
            "backend %s (pool %s) ejected for %g s: %d requests failed in a row",
            *self._names,
            self.ejected_for,
            self._requests_failed,
        )
        self._requests_failed = self._probes_passed = self._probes_failed = 0
        return True

    def request_succeeded(self) -> None:
        self._requests_failed = 0
        self.ejections = 0

    def ejected_left(self, now: float) -> float:
        return max(0.0, self.ejected_until - now)
