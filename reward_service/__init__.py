"""Parallax reward_service package."""
