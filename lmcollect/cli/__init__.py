"""The `lmcollect` command line."""
