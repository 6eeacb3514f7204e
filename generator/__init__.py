"""Parallax generator package."""
