"""Model specs: built-in configs and overrides, the hf: adapter, and bad model input."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise.errors import UserError
from shardwise.ir.trace import trace_model
from shardwise.models import get_model, known_models
from tests.helpers import hf_model_name

# Published parameter count of Llama 3 8B (Meta's model card: 8.03B).
LLAMA3_8B_PARAMS = 8_030_261_248


def n_params_meta(spec) -> int:
    with torch.device("meta"):
        module = spec.build_module()
    return sum(p.numel() for p in module.parameters())


def test_llama3_8b_has_the_published_parameter_count():
    assert n_params_meta(get_model("llama3-8b")) == LLAMA3_8B_PARAMS


def test_overrides_change_layers_shapes_and_dtype():
    spec = get_model("llama-tiny", layers=3, batch=2, seq=8, dtype="bf16")
    assert (spec.n_layers, spec.batch, spec.seq, spec.dtype) == (3, 2, 8, torch.bfloat16)
    module = spec.build_module()
    assert len(module.layers) == 3
    assert all(p.dtype is torch.bfloat16 for p in module.parameters())
    tokens, labels = spec.example_inputs(train=True, seed=3)
    assert tokens.shape == labels.shape == (2, 8)
    assert int(tokens.max()) < spec.vocab_size
    again, _ = spec.example_inputs(train=True, seed=3)
    assert torch.equal(tokens, again)
    assert len(spec.example_inputs(train=False)) == 1


@pytest.mark.parametrize("bad", [{"layers": 0}, {"layers": -2}, {"batch": 0}, {"seq": -1}])
def test_non_positive_sizes_are_rejected(bad):
    with pytest.raises(UserError, match="positive integer"):
        get_model("llama-tiny", **bad)


def test_unknown_model_lists_known_names():
    with pytest.raises(UserError) as e:
        get_model("llama9-1t")
    for name in known_models():
        assert name in str(e.value)


def test_unknown_dtype_is_rejected():
    with pytest.raises(UserError, match="dtype"):
        get_model("llama-tiny", dtype="int3")


def _write(tmp_path, text: str):
    p = tmp_path / "config.json"
    p.write_text(text)
    return f"hf:{p}"


@pytest.mark.parametrize(("content", "message"), [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ('{"hidden_size": 8}', "model_type"),
    ('{"model_type": "surely_not_an_architecture"}', "does not know the architecture"),
    ('{"model_type": "llama", "num_hidden_layers": 2, "layer_types": ["full_attention"]}',
     "not a valid llama config"),
    ('{"model_type": "mixtral", "num_local_experts": 8}',
     r"mixture-of-experts model \(num_local_experts = 8\)"),
    # named as the file names it, though transformers reads it as num_local_experts
    ('{"model_type": "qwen3_moe", "num_experts": 4}', r"mixture-of-experts model \(num_experts = 4\)"),
])
def test_bad_hf_configs_are_one_sentence_user_errors(tmp_path, content, message):
    name = f"hf:{tmp_path / 'missing.json'}" if content is None else _write(tmp_path, content)
    with pytest.raises(UserError, match=message) as e:
        get_model(name)
    assert "\n" not in str(e.value)


def test_hf_config_that_is_a_directory_is_unreadable(tmp_path):
    with pytest.raises(UserError, match="cannot be read"):
        get_model(f"hf:{tmp_path}")


def test_hf_layer_override_and_defaults():
    spec = get_model(hf_model_name("qwen2"), layers=1)
    assert spec.n_layers == 1 and spec.dtype is torch.float32
    with FakeTensorMode():
        module = spec.build_module()
    assert len(module.model.model.layers) == 1
    # Qwen2's q/k/v projections carry a bias; the built model has no real storage
    assert module.model.model.layers[0].self_attn.q_proj.bias is not None


def test_hf_mistral_traces_forward():
    traced = trace_model(hf_model_name("mistral"), layers=1, train=False)
    (out,) = traced.outputs
    spec = get_model(hf_model_name("mistral"))
    assert tuple(traced.node(out).meta["val"].shape) == (spec.batch, spec.seq, spec.vocab_size)
    with FakeTensorMode():
        assert type(spec.build_module().model).__name__ == "MistralForCausalLM"


TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 256}


def test_a_config_its_layers_refuse_is_a_user_error(tmp_path):
    """transformers' config checks pass (a warning), its embedding's constructor asserts."""
    spec = get_model(_write(tmp_path, json.dumps({**TINY_LLAMA, "pad_token_id": 300})))
    with pytest.raises(UserError, match="cannot build a causal LM from this config: AssertionError") as e:
        with FakeTensorMode():
            spec.build_module()
    assert "\n" not in str(e.value)


def test_a_forward_that_fails_on_the_shapes_is_a_user_error(tmp_path):
    """3 KV heads for 4 query heads: the model builds, its attention fails while being traced."""
    name = _write(tmp_path, json.dumps({**TINY_LLAMA, "num_key_value_heads": 3}))
    with pytest.raises(UserError, match="forward cannot be traced on fake tensors: RuntimeError") as e:
        trace_model(name)
    assert "\n" not in str(e.value)


def test_an_architecture_without_sdpa_traces_its_eager_attention():
    """Gemma-2 soft-caps its attention scores, which SDPA cannot: its attention is transformers'
    eager one (matmuls, tanh, softmax), the rest as for any family."""
    sdpa = trace_model(hf_model_name("llama"), layers=1, train=False)
    eager = trace_model(hf_model_name("gemma2"), layers=1, train=False)
    assert get_model(hf_model_name("gemma2")).build_module().model.config._attn_implementation == "eager"

    def targets(traced):
        return {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert any("scaled_dot_product" in t for t in targets(sdpa))
    assert not any("scaled_dot_product" in t for t in targets(eager))
    assert {"aten._softmax.default", "aten.tanh.default"} <= targets(eager)
