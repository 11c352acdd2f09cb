"""Writes docs/convert.md from the run files (placeholder until the runs exist)."""
