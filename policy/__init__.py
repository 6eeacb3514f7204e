"""Parallax policy package."""
