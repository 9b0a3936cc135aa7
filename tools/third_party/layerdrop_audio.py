"""A third-party speech encoder with LayerDrop as a dynn-runtime workload:
``tools/third_party/layerdrop_audio.py:build``.

Hugging Face ``transformers``' wav2vec 2.0 (``Wav2Vec2ForSequenceClassification``), a tiny randomly
initialised configuration (nothing is downloaded): a convolutional feature encoder over raw audio
of a length drawn per step, then transformer layers each skipped with probability ``layerdrop``
during training (LayerDrop, structured stochastic depth: a skipped layer runs no operator), then
utterance classification. Which layers run and how long the sequence is change per step.
Evaluation only: never in the pilot's training data. Needs ``transformers`` (docs/pilot.md,
"Networks outside the zoo").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: preset -> (hidden size, layers, shortest and longest audio in samples, largest batch)
PRESETS = {"tiny": (32, 12, 2000, 6000, 4), "small": (128, 12, 8000, 32000, 8)}


class LayerDropAudio:
    def __init__(self, preset: str) -> None:
        from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

        if preset not in PRESETS:
            raise ValueError(f"layerdrop_audio: preset {preset!r} is not one of {', '.join(PRESETS)}.")
        hidden, layers, self.min_len, self.max_len, self.max_batch = PRESETS[preset]
        cfg = Wav2Vec2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                             intermediate_size=2 * hidden, conv_dim=(16, 16, 16), conv_stride=(5, 4, 2),
                             conv_kernel=(10, 4, 2), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                             layerdrop=0.4, mask_time_prob=0.0, num_labels=5, classifier_proj_size=16,
                             hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                             feat_proj_dropout=0.0, final_dropout=0.0, attn_implementation="eager")
        torch.manual_seed(0)
        self.model = Wav2Vec2ForSequenceClassification(cfg)

    def make_batch(self, step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(2000 + step)
        n = int(torch.randint(1, self.max_batch + 1, (1,), generator=g))
        length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=g))
        return {"input_values": torch.randn(n, length, generator=g), "labels": torch.randint(0, 5, (n,), generator=g)}

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return model(input_values=batch["input_values"], labels=batch["labels"]).loss


def build(preset: str) -> LayerDropAudio:
    return LayerDropAudio(preset)
