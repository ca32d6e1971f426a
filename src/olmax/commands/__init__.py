"""Subcommands of the olmax CLI, one module each."""
