"""Which module computes each checkpoint architecture: ``architectures[0]`` of a
``config.json`` (the transformers class) to its :class:`~hicache.models.hf.family.ModelFamily`.

Serving a new architecture is one module beside these (its config, its tensors, its model) and
one line here.
"""

from __future__ import annotations

from hicache.models.hf.deepseek import DEEPSEEK_V3
from hicache.models.hf.dense import DENSE, LLAMA, QWEN2, QWEN3
from hicache.models.hf.family import ModelFamily
from hicache.models.hf.jamba import JAMBA

__all__ = ["FAMILIES"]

FAMILIES: dict[str, ModelFamily] = {
    LLAMA: DENSE,
    QWEN2: DENSE,
    QWEN3: DENSE,
    "DeepseekV3ForCausalLM": DEEPSEEK_V3,
    "JambaForCausalLM": JAMBA,
}
