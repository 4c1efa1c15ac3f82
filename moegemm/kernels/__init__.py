"""Private kernel families: portable (tl, GPU and CPU interpreter)."""
