"""Serving real models: Hugging Face checkpoint directories (``config.json`` and safetensors
weights) loaded into models the serving engine runs over the paged pools."""
