"""Tier 4: benchmarks (things people run). Imports the lower tiers, never the other way round."""
