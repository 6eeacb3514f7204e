"""Parallax deploy package."""
