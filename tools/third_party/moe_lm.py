"""A third-party mixture-of-experts causal LM as a dynn-runtime workload: ``tools/third_party/moe_lm.py:build``.

Hugging Face ``transformers``' Mixtral (``MixtralForCausalLM``), a tiny randomly initialised
configuration (nothing is downloaded): top-2 routing over 4 experts per layer, the experts run only
on the tokens routed to them, so which expert slices are read and at what shapes changes per
batch; batch size and sequence length are drawn per step. Evaluation only: never in the pilot's
training data. Needs ``pip install --no-deps transformers`` and its non-torch dependencies
(docs/pilot.md, "Networks outside the zoo").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: preset -> (hidden size, layers, experts, vocabulary, longest sequence, largest batch)
PRESETS = {"tiny": (32, 2, 4, 128, 48, 6), "small": (128, 4, 8, 512, 128, 8)}


class MoeLM:
    def __init__(self, preset: str) -> None:
        from transformers import MixtralConfig, MixtralForCausalLM

        if preset not in PRESETS:
            raise ValueError(f"moe_lm: preset {preset!r} is not one of {', '.join(PRESETS)}.")
        hidden, layers, experts, self.vocab, self.max_len, self.max_batch = PRESETS[preset]
        cfg = MixtralConfig(vocab_size=self.vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=256,
                            attn_implementation="eager", use_cache=False, router_aux_loss_coef=0.01,
                            output_router_logits=True)
        torch.manual_seed(0)
        self.model = MixtralForCausalLM(cfg)

    def make_batch(self, step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        n = int(torch.randint(2, self.max_batch + 1, (1,), generator=g))
        length = int(torch.randint(8, self.max_len + 1, (1,), generator=g))
        return {"input_ids": torch.randint(0, self.vocab, (n, length), generator=g)}

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids).loss


def build(preset: str) -> MoeLM:
    return MoeLM(preset)
