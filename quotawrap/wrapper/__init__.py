"""wrapper: see docs/internals.md for what this layer holds."""
