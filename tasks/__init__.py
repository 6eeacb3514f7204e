"""Parallax tasks package."""
