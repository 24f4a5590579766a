"""Deployment generators: docker-compose and Kubernetes manifests from a placement YAML
(``topology.py`` is the one service list both render), the Grafana dashboard, and the
containers' health probe. CLI: ``mstar deploy compose|k8s --config FILE``."""
