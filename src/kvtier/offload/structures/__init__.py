"""Ordered structures the policies are built on (no policy decisions of their own)."""
