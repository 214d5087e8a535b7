"""`python -m megatrain.cli` (how `megatrain demo` starts a detached `megatrain up`)."""

from megatrain.cli import main

main()
