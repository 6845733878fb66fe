"""How a canary moves traffic: one small interface, as Argo Rollouts keeps every traffic router behind one.

The step loop (canary/controller.py) asks a traffic split for four things only: set the candidate's weight,
read the requests it saw, read the shadow comparisons, and drain (send nothing to the candidate any more).
Implementations:
- gateway.admin.RemoteRouter: a gateway's admin endpoint (its samples come from the gateway): a running
  `quantgate serve`, or the in-process gateway a canary run without `--gateway` starts (gateway/inprocess.py);
- gateway.router.Router: the router itself, which the admin endpoint drives (the same four methods);
- canary.render.RouteSplit: Kubernetes Gateway API HTTPRoutes, one written per weight; it sees no requests
  (a cluster's own metrics judge there), so a canary on it is judged by whoever reads those.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gateway.metrics import Sample, ShadowSample


@runtime_checkable
class TrafficSplit(Protocol):
    """Set weight, read samples, read shadows, drain."""

    def set_weight(self, percent: float) -> None:
        """Send `percent` (0-100) of requests to the candidate from now on."""

    def samples_since(self, t: float) -> list[Sample]:
        """The backend attempts that started at or after `t` (epoch seconds)."""

    def shadows_since(self, t: float) -> list[ShadowSample]:
        """The shadow comparisons made at or after `t`."""

    def drain(self) -> None:
        """Send nothing more to the candidate (weight 0): the end of every canary, promoted or not."""
