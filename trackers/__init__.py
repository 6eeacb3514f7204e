"""Experiment trackers: the sinks a step's metrics go to (metrics.jsonl, TensorBoard, Weights & Biases)."""
