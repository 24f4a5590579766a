"""M*: a gRPC microservice mesh serving composite multimodal models.

The SDK is exported lazily (``from mstar import MStarClient``) so that the services, which
import ``mstar.*`` modules, never pay for it.

Installed, the repository's top-level folders (services, models, conductor, gateway) are
subpackages of ``mstar`` (pyproject.toml's package-dir). From a source checkout that is not
installed (``PYTHONPATH=<checkout>``, or ``python -m mstar.cli`` at its root) the checkout's root
is added to this package's path, which maps them the same way.
"""

from pathlib import Path as _Path

_ROOT = _Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "services" / "__init__.py").is_file():
    __path__.append(str(_ROOT))  # noqa: F821 (a package's __path__)

_SDK = ("MStarClient", "AsyncMStarClient", "MStarError", "InvalidArgument", "NotFound", "AlreadyExists",
        "ResourceExhausted", "Cancelled", "Unavailable", "DeadlineExceeded", "Internal")


def __getattr__(name: str):
    if name in _SDK:
        import mstar.client

        return getattr(mstar.client, name)
    raise AttributeError(f"module 'mstar' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_SDK])


__all__ = list(_SDK)
