"""Launching Parallax: `python -m deploy` runs the whole pipeline on one machine as separate processes
(launcher.py, its stages and supervision), with its plan, preflight checks, progress and resume; the GPU
layout decisions live in deploy/gpus/. Beside the code: the shipped TOML configs, Dockerfiles, docker
compose, Prometheus and Grafana provisioning (described in docs/compose.md and docs/metrics.md)."""
