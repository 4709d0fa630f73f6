"""`detinf` command-line interface: thin commands that delegate to the package modules."""
