"""A user's own callable named in the run config by reference: ``package.module:callable``.

The ``module:attribute`` form is Flower's own (a ServerApp's or ClientApp's reference,
``flwr.supercore.object_ref``): the module is imported from the Python path (an installed
package, ``PYTHONPATH``, or the app folder a FAB unpacks to) and the attribute, which may be
dotted (``module:Class.build``), is looked up in it. ``model`` and ``dataset`` take a
reference where they take a registered name (docs/your-own-model.md); every problem is a
:class:`~dpfl.errors.ConfigError` on one line naming the key.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

from dpfl.errors import ConfigError

#: ``package.module:attribute.path``: Python identifiers, dotted on both sides of one colon
REFERENCE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
#: what every refusal of a reference offers instead
FORM = "a registered name, or package.module:callable importable from the Python path"


def is_reference(value: object) -> bool:
    """Whether a run-config value names a callable by reference (it holds a colon)."""
    return isinstance(value, str) and ":" in value


def resolve(key: str, reference: str) -> Callable[..., Any]:
    """The callable ``reference`` names, imported; a ConfigError on ``key`` for a malformed
    reference, a module that is not found or fails to import, a missing attribute, or one that
    is not callable."""
    if not REFERENCE.fullmatch(reference):
        raise ConfigError(key, f"{reference!r} is not a reference", allowed=FORM)
    module_name, _, attribute = reference.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise ConfigError(key, f"{reference!r}: importing {module_name} failed: "
                              f"{first_line(exc)}") from None
        raise ConfigError(key, f"{reference!r}: module {exc.name!r} is not on the Python path "
                          "(install its package, or add the folder holding it to PYTHONPATH)",
                          allowed=FORM) from None
    except Exception as exc:  # the user's module raised while it was imported
        raise ConfigError(key, f"{reference!r}: importing {module_name} failed: "
                          f"{type(exc).__name__}: {first_line(exc)}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(key, f"{reference!r}: {target.__name__} has no attribute "
                              f"{part!r}", allowed=FORM)
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(key, f"{reference!r} is not callable (it is of type "
                          f"{type(target).__name__})", allowed=FORM)
    return target


def keyword_parameters(function: Callable[..., Any], reserved: tuple[str, ...]
                       ) -> tuple[dict[str, Any], bool]:
    """The parameters of ``function`` that a keyword can give, but ``reserved`` (those dpfl
    fills in), with their defaults (``inspect.Parameter.empty`` where there is none), and
    whether it takes any keyword (``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: anything goes
        return {}, True
    named = {p.name: p.default for p in parameters if p.name not in reserved and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def accepted(function: Callable[..., Any], provided: dict[str, Any]) -> dict[str, Any]:
    """The ``provided`` values ``function`` declares by name (all of them where it takes
    ``**kwargs``): what dpfl fills in, where the user's signature asks for it."""
    named, takes_any = keyword_parameters(function, ())
    return {k: v for k, v in provided.items() if takes_any or k in named}


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (a refusal is one line)."""
    return (str(exc).strip().splitlines() or [""])[0]
