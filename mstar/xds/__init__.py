"""The Envoy front proxy's control plane: an xDS (ADS, state of the world) server that tells
Envoy where the gateway, the conductor and the node groups are, from target files and its
own health checks (``server.py``), and the helper that runs Envoy itself (``envoy.py``)."""
