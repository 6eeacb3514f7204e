"""Process runtime shared by every role: config loading, GPU selection, metrics server, run directory."""
