"""``hicache bench seed``: each measured claim of the seed design, beside the seed's figure."""
