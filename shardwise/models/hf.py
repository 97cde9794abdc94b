"""Hugging Face ``transformers`` causal LMs built from a ``config.json`` (no weights, no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from shardwise.errors import UserError


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
    """Read a config.json into a transformers ``PretrainedConfig`` (SDPA attention)."""
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
        first_line = _cause(e)
        raise UserError(f"hf config file {path!r} is not a valid {model_type} config: {first_line}") from None
    if layers is not None:
        cfg.num_hidden_layers = layers
        if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
            cfg.layer_types = list(cfg.layer_types)[:layers] + [cfg.layer_types[-1]] * max(
                0, layers - len(cfg.layer_types)
            )
        if hasattr(cfg, "max_window_layers"):
            cfg.max_window_layers = min(cfg.max_window_layers, layers)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_hf(cfg, dtype: torch.dtype) -> nn.Module:
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    except ValueError as e:
        first_line = str(e).split("\n")[0]
        raise UserError(f"transformers cannot build a causal LM from this config: {first_line}") from None
    return HFCausalLM(model)


def _cause(e: Exception) -> str:
    """One line naming why a config was rejected (the innermost message of a chained error)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else e.__class__.__name__
    return text if text.endswith(".") else text + "."
