"""M*: a gRPC microservice mesh serving composite multimodal models.

The SDK is exported lazily (``from mstar import MStarClient``) so that the services, which
import ``mstar.*`` modules, never pay for it.
"""

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
