"""The hicache command line."""
