"""``hicache inspect|verify|compact|stats URL``: the operating tools over a store."""
