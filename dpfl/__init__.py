"""dpfl: differentially private federated learning with clipping-aware optimizers on Flower.

The public API (docs/your-own-app.md): :class:`PrivateFederation` describes a private run of a
Flower app of one's own and builds its server side (a Flower ``Strategy``) and, with
:func:`client_app`, its client side (a ``ClientApp``). Everything else is reached through the
``dpfl`` command and the run config (docs/configuration.md). The names are loaded on first use,
so that ``import dpfl`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpfl.version import __version__

__all__ = ["PrivateFederation", "PrivateStrategy", "__version__", "client_app"]

if TYPE_CHECKING:
    from dpfl.private_federation import PrivateFederation, PrivateStrategy, client_app


def __getattr__(name: str) -> Any:
    if name in ("PrivateFederation", "PrivateStrategy", "client_app"):
        from dpfl import private_federation

        return getattr(private_federation, name)
    raise AttributeError(f"module 'dpfl' has no attribute {name!r}")
