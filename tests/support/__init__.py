"""Code only the tests use: the metric catalogue of docs/metrics.md (catalog.py), deploy/docker-compose.yml
read without Docker (compose.py), the Grafana dashboard script loaded as a module (dashboard.py) and the
TensorBoard and W&B files of the metrics sinks read back (trackers.py), the tiny learner's config
(learner.py)."""
