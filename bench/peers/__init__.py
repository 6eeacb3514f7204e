"""Parallax beside TRL and verl on one GPU, the same model, prompts and workload (bench/peers/README.md)."""
