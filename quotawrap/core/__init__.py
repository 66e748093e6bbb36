"""Pure rules: no I/O, no clock, no store (the bottom layer)."""
