"""Every model the serving engine runs, over the paged device pools.

* The types the engine and the models exchange: :mod:`~hicache.models.types` (``ServingModel``,
  ``ChunkInput``, ``LayerWait``, ``DecodePages``) and the model's shape and pools,
  :mod:`~hicache.models.config` (``ModelConfig``, ``LayerKind``, ``ModelPreset``).
* The blocks, each written once: the step loop (:mod:`~hicache.models.step`), attention over
  the paged KV (:mod:`~hicache.models.attention`), the rotary embedding
  (:mod:`~hicache.models.rope`), RMSNorm, the MLP and routed experts
  (:mod:`~hicache.models.layers`), sliding windows (:mod:`~hicache.models.window`), MLA
  (:mod:`~hicache.models.latent`), DSA (:mod:`~hicache.models.sparse`), dsv4's compressed
  layers (:mod:`~hicache.models.compressed`), recurrent state (:mod:`~hicache.models.recurrent`)
  and Jamba's Mamba mixer (:mod:`~hicache.models.mamba`).
* The models: the seeded presets (:mod:`~hicache.models.tiny`) and the checkpoint architectures
  (:mod:`hicache.models.hf`).
"""
