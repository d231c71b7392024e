"""Offline stage: greedy accuracy-aware knowledge fusion that packs domains into the fewest adapters."""
