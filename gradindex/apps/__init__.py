"""Applications on a built index: outliers by self-influence, gradient-space deduplication."""
