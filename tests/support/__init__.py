"""Code only the tests use: the metric catalogue of docs/metrics.md (catalog.py), deploy/docker-compose.yml
read without Docker (compose.py) and the Grafana dashboard script loaded as a module (dashboard.py)."""
