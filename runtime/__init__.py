"""Process runtime shared by every Parallax role: config loading, GPU selection, metrics server, run directory."""
