"""Sequence-classification checkpoints of the decoder families (transformers' `*ForSequenceClassification`):
the same decoder as the family's causal LM, with a `score` layer (hidden -> num_labels, no bias) read at the
last position instead of the LM head. The checkpoint has no `lm_head`, so the model's LM head is tied to the
embeddings (a stand-in that costs no memory); the executor serves such a model's pooled items only
(executor_service/step/pooling.py)."""
from __future__ import annotations

from typing import Any

from models.families import base
from tandem.errors import CheckpointError

# *ForSequenceClassification -> the causal LM whose decoder it has (the layout facts are that family's)
CAUSAL_OF = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}


def num_labels(raw: dict[str, Any], source: str) -> int:
    """transformers writes the labels as id2label (num_labels is a property of it); num_labels if given."""
    labels = raw.get("num_labels") or len(raw.get("id2label") or {}) or 2
    if not isinstance(labels, int) or labels < 1:
        raise CheckpointError(f"{source}: a classification head needs num_labels >= 1, got {labels!r}")
    return labels


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    fields = base.parse(raw, CAUSAL_OF[arch], source)
    fields.update(checkpoint_architecture=arch, num_labels=num_labels(raw, source), tie_word_embeddings=True)
    return fields
