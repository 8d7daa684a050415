"""Engine and AsyncEngine behaviour: streaming, overlap, warm-up, sessions, tiers, faults."""
