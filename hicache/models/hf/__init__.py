"""Serving Hugging Face checkpoints: a directory's ``config.json`` and safetensors weights read
into the model of its architecture (:mod:`~hicache.models.hf.registry`), which the serving
engine runs over the paged pools; its fingerprint and its tokenizer."""
