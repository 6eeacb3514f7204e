"""Parallax learner package."""
