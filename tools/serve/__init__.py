"""``hicache serve``: the serving loop, its flags, and its HTTP and multi-worker modes."""
