"""``hicache bench ...``: each benchmark against a baseline measured in the same run."""
