"""The bidirectional encoder family (BERT, XLM-RoBERTa: bge-small, bge-m3, e5, ...) as a pooling model.

Every token attends to every token of its own prompt, in both directions, within the one prefill step that
holds the whole prompt: no K/V is cached or read (the engine refuses a step budget smaller than
max_model_len, and the scheduler never splits such a prompt). The runner's `query_seq` (each token's prompt in
the step, -1 for padding) gives the attention mask. Parameter names are transformers' (`embeddings.*`,
`encoder.layer.N.*`), so checkpoints load by name; a `bert.` / `roberta.` prefix, the pooler and any task head
are skipped. XLM-RoBERTa numbers its positions from pad_token_id + 1, as transformers does for an unpadded
prompt.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron.model.base import CausalLM, ModelSpec, Target
from vllm_neuron.model.layers.linear import EncoderLinear

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
_SKIPPED_PREFIXES = ("pooler.", "cls.", "lm_head.", "classifier.", "qa_outputs.")


def _activation(hf_config):
    act = getattr(hf_config, "hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not supported for {hf_config.model_type}; supported: "
                         f"{sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[act]


class _Embeddings(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(int(getattr(c, "type_vocab_size", 1) or 1), 1), c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids, position_ids):
        # Every token is of type 0: one text per prompt (a pair is encoded as one text by the tokenizer).
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.query, self.key, self.value = EncoderLinear(h, h), EncoderLinear(h, h), EncoderLinear(h, h)


class _Dense(nn.Module):
    """transformers' `*.output`: dense, then LayerNorm over the residual."""

    def __init__(self, c, d_in: int) -> None:
        super().__init__()
        self.dense = EncoderLinear(d_in, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x, residual):
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        setattr(self, "self", _SelfAttention(c))  # transformers' name for the q/k/v module
        self.output = _Dense(c, c.hidden_size)

    def forward(self, x, mask):
        sa = getattr(self, "self")
        n, h = x.shape[0], sa.heads
        q, k, v = (lin(x).view(n, h, -1).transpose(0, 1) for lin in (sa.query, sa.key, sa.value))
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None])[0]
        return self.output(out.transpose(0, 1).reshape(n, -1), x)


class _Intermediate(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.dense = EncoderLinear(c.hidden_size, c.intermediate_size)


class _Layer(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = _Intermediate(c)
        self.output = _Dense(c, c.intermediate_size)
        self.act = _activation(c)

    def forward(self, x, mask):
        x = self.attention(x, mask)
        return self.output(self.act(self.intermediate.dense(x)), x)


class _Encoder(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.layer = nn.ModuleList([_Layer(c) for _ in range(c.num_hidden_layers)])


class BertEncoderModel(CausalLM):
    """BertModel / XLMRobertaModel: hidden states [N, hidden] of N (padded) tokens; a pooling model only."""

    bidirectional = True  # worker/pooling.py passes query_seq; the engine keeps each prompt in one step
    pooling_task = "embed"

    @classmethod
    def spec(cls, hf_config) -> ModelSpec:
        # No KV cache is read or written; the runner's pool gets the smallest layout (one layer, one head).
        return ModelSpec(1, 1, hf_config.hidden_size // hf_config.num_attention_heads, (None,), quantizations=())

    @staticmethod
    def position_offset(hf_config) -> int:
        """XLM-RoBERTa's positions start after its padding index."""
        return int(hf_config.pad_token_id) + 1 if hf_config.model_type == "xlm-roberta" else 0

    @classmethod
    def max_positions(cls, hf_config) -> int:
        return hf_config.max_position_embeddings - cls.position_offset(hf_config)

    def __init__(self, hf_config, quantization: str | None = None) -> None:
        super().__init__()
        if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type={hf_config.position_embedding_type!r} is not supported; "
                             "supported: 'absolute'")
        self.model_spec = self.spec(hf_config)
        self.offset = self.position_offset(hf_config)
        self.embeddings = _Embeddings(hf_config)
        self.encoder = _Encoder(hf_config)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None, query_seq=None):
        if query_seq is None:
            raise ValueError("a bidirectional encoder needs each token's prompt (query_seq)")
        mask = query_seq[:, None] == query_seq[None, :]  # the whole prompt, both directions; padding apart
        x = self.embeddings(input_ids, positions + self.offset)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError("a bidirectional encoder is a pooling model: it has no logits")

    def checkpoint_target(self, name: str) -> Target | None:
        for prefix in ("bert.", "roberta."):
            name = name.removeprefix(prefix)
        if name.startswith(_SKIPPED_PREFIXES) or name.endswith(("position_ids", "token_type_ids")):
            return None
        return name, None, None
