"""Pure rules: no I/O, table-tested; every other layer builds on them."""
