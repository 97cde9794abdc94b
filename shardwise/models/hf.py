"""Hugging Face ``transformers`` causal LMs built from a ``config.json`` (no weights, no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from shardwise.errors import UserError, first_line


class HFCausalLM(nn.Module):
    """Wraps a transformers causal LM in the ``forward(tokens, labels=None)`` convention."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        if getattr(model, "loss_type", None) is None:
            # A causal LM's loss is cross-entropy on the shifted tokens; without it named, some
            # families (GPT-2) warn on stderr at every first loss that they fall back to it.
            model.loss_type = "ForCausalLM"

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = self.model(input_ids=tokens, labels=labels, use_cache=False)
        return out.logits if labels is None else out.loss


def load_config(path: str, *, layers: int | None = None):
    """Read a config.json into a transformers ``PretrainedConfig``, its attention implementation
    chosen (``attention_implementation``)."""
    import transformers

    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"hf config file {path!r} does not exist; pass hf:path/to/config.json.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"hf config file {path!r} cannot be read ({e.__class__.__name__}).") from None
    except json.JSONDecodeError as e:
        raise UserError(f"hf config file {path!r} is not valid JSON (line {e.lineno}: {e.msg}).") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UserError(f"hf config file {path!r} has no 'model_type'; it is not a transformers config.")
    model_type = raw.pop("model_type")
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise UserError(f"transformers does not know the architecture {model_type!r} named in {path!r}.")
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **raw)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:
        # transformers validates some fields through huggingface_hub's strict dataclasses; the
        # cause is on the error's last line ("ValueError: ...").
        raise UserError(f"hf config file {path!r} is not a valid {model_type} config: {_cause(e)}") from None
    if layers is not None:
        cfg.num_hidden_layers = layers
        if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
            cfg.layer_types = list(cfg.layer_types)[:layers] + [cfg.layer_types[-1]] * max(
                0, layers - len(cfg.layer_types)
            )
        if hasattr(cfg, "max_window_layers"):
            cfg.max_window_layers = min(cfg.max_window_layers, layers)
    _refuse_experts(cfg, raw, path)
    cfg._attn_implementation = attention_implementation(cfg)
    return cfg


# Config fields that count a mixture-of-experts layer's routed experts (Mixtral, Qwen2/3-MoE and
# OLMoE, DeepSeek, DBRX-style configs).
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _refuse_experts(cfg, raw: dict, path: str) -> None:
    """Mixture-of-experts layers are refused: transformers runs their routed experts as grouped
    matmuls over token counts known only at run time (``_grouped_mm`` with data-dependent
    offsets), which shardwise has no sharding strategy or cost for, and whose router writes its
    weights in place. The field is named as the file names it (transformers aliases some)."""
    fields = [(name, raw[name]) for name in EXPERT_COUNT_FIELDS if name in raw]
    for name, n in fields + [(name, getattr(cfg, name, None)) for name in EXPERT_COUNT_FIELDS]:
        if isinstance(n, int) and n > 1:
            raise UserError(f"hf config file {path!r} describes a mixture-of-experts model ({name} = {n}); "
                            "shardwise does not plan routed experts yet.")


def attention_implementation(cfg) -> str:
    """SDPA where transformers has it for the architecture (one fused attention op, priced and
    sharded as one), else its eager attention: matmuls, a softmax and the architecture's own
    extras (Gemma-2's soft-capped scores have no SDPA path), which trace and shard like any
    other ops."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
    return "sdpa" if cls is None or cls._supports_sdpa else "eager"


def build_hf(cfg, dtype: torch.dtype) -> nn.Module:
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=cfg._attn_implementation, dtype=dtype)
    except Exception as e:  # a config transformers' own checks miss fails in its layers' constructors
        raise UserError(f"transformers cannot build a causal LM from this config: {first_line(e)}") from None
    return HFCausalLM(model)


def _cause(e: Exception) -> str:
    """One line naming why a config was rejected (the innermost message of a chained error)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else e.__class__.__name__
    return text if text.endswith(".") else text + "."
