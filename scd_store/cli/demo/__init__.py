"""``make demo``: the story scd-store exists for, on the embedded store (CPU + disk, no server)."""
