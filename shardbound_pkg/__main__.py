"""`python -m shardbound ...`: the same as the `shardbound` command."""

from shardbound.compiler.cli import main

main()
