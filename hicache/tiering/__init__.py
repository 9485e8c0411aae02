"""The tiered cache: the radix tree over device, host and L3, and the parts it is built from."""
