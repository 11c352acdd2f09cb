"""Tier 5: the papers' experiments on real data (``linattn experiment NAME``), and docs/results.md.

Imports every lower tier; nothing imports this package. Each experiment module stays unimported
until its command runs.
"""

EXPERIMENTS = ("copy", "mnist", "shakespeare", "proteins", "mqar")

__all__ = ["EXPERIMENTS"]
