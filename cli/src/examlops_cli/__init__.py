"""The `exa` command line."""
