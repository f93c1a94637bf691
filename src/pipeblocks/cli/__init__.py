"""The `pipeblocks` command line."""
