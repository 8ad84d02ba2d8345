"""The global scheduler: placement, per-cell routing, reply merging, failure detection."""
