"""A real client: a small Llama-family model (grouped-query heads, random weights, no download)
runs a left-padded batch through our backends and matches the same model on SDPA."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency (extra 'hf')")

import common.hf  # noqa: E402


@pytest.fixture(scope="module")
def registered():
    return common.hf.register()


def tiny_llama(dtype, device, implementation):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation(implementation)
    return model


def left_padded_batch(device, padded=True):
    torch.manual_seed(1)
    input_ids = torch.randint(1, 128, (2, 12), device=device)
    attention_mask = torch.ones(2, 12, dtype=torch.long, device=device)
    if padded:
        attention_mask[0, :5] = 0  # the first sequence is 5 tokens shorter, padded on the left
    return input_ids, attention_mask


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no-padding"])
def test_logits_match_sdpa(registered, backend, dtype, padded, device):
    """With padding the model passes a boolean mask; without, no mask and is_causal."""
    input_ids, attention_mask = left_padded_batch(device, padded)
    with torch.no_grad():
        ours = tiny_llama(dtype, device, backend)(input_ids=input_ids, attention_mask=attention_mask).logits
        sdpa = tiny_llama(dtype, device, "sdpa")(input_ids=input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()  # padded positions attend to nothing; their logits are not defined
    tolerance = {torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(ours[real], sdpa[real], rtol=tolerance, atol=tolerance)


def test_generation_matches_sdpa(registered, backend, device):
    """Prefill with a padding mask, then decode one token at a time from the cache."""
    input_ids, attention_mask = left_padded_batch(device)
    outputs = {}
    for implementation in (backend, "sdpa"):
        model = tiny_llama(torch.float32, device, implementation)
        with torch.no_grad():
            outputs[implementation] = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False,
                pad_token_id=0,
            )
    assert torch.equal(outputs[backend], outputs["sdpa"])


def test_training_is_rejected_clearly(registered, backend, device):
    model = tiny_llama(torch.float32, device, backend)
    input_ids, attention_mask = left_padded_batch(device)
    with pytest.raises(ValueError, match="requires grad, but the .* backend has no backward pass"):
        model(input_ids=input_ids, attention_mask=attention_mask)
