"""A real client: a small Llama-family model (grouped-query heads, random weights, no download)
runs a left-padded batch through our backends and matches the same model on SDPA."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency (extra 'hf')")

import common.hf  # noqa: E402


@pytest.fixture(scope="module")
def registered():
    return common.hf.register()


def tiny_llama(dtype, device, implementation, attention_dropout=0.0):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=attention_dropout,
    )
    return build(transformers.LlamaForCausalLM, config, implementation, device, dtype)


def build(model_class, config, implementation, device, dtype=torch.float32):
    """A model with seeded weights (the same for every implementation), in eval mode."""
    torch.manual_seed(0)
    model = model_class(config).to(device=device, dtype=dtype).eval()
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


def test_training_step_matches_sdpa(registered, backend, device):
    """Loss, backward and an optimizer step of the same model on our backend and on SDPA agree."""
    input_ids, attention_mask = left_padded_batch(device)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    results = {}
    for implementation in (backend, "sdpa"):
        model = tiny_llama(torch.float32, device, implementation).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        grads = {name: p.grad.norm().item() for name, p in model.named_parameters()}
        optimizer.step()
        results[implementation] = (loss.item(), grads, [p.detach().clone() for p in model.parameters()])
    (loss, grads, params), (sdpa_loss, sdpa_grads, sdpa_params) = results[backend], results["sdpa"]
    assert abs(loss - sdpa_loss) <= 1e-5 * abs(sdpa_loss)
    assert grads.keys() == sdpa_grads.keys()
    attention_grads = [name for name in grads if "self_attn" in name]
    assert attention_grads and all(grads[name] > 0 for name in attention_grads)
    for name in grads:
        assert abs(grads[name] - sdpa_grads[name]) <= 1e-4 * max(sdpa_grads[name], 1e-3), name
    for p, sdpa_p in zip(params, sdpa_params):
        torch.testing.assert_close(p, sdpa_p, rtol=1e-5, atol=1e-5)


def _dropout_reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """Attention with dropout in float64 plain torch, the mask from ``common.reference.dropout_keep``
    and the seed drawn as our backends draw it: the same model trained on it must
    match ours exactly (SDPA's own dropout draws other masks)."""
    from common.ops import new_seed
    from common.reference import dropout_keep, reference_dropout

    B, H, Lq, _ = query.shape
    is_causal = bool(getattr(module, "is_causal", True)) and attention_mask is None and Lq > 1
    keep = dropout_keep(int(new_seed(query.device)), B, H, Lq, key.shape[2], dropout, device=query.device)
    out = reference_dropout(query, key, value, keep, dropout, is_causal=is_causal, scale=scaling,
                            attn_mask=attention_mask)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def train_step(implementation, device, attention_dropout):
    input_ids, attention_mask = left_padded_batch(device)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    model = tiny_llama(torch.float32, device, implementation, attention_dropout).train()
    torch.manual_seed(42)  # the dropout masks' seeds come from here
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    return loss.item(), {name: p.grad.norm().item() for name, p in model.named_parameters()}


def test_training_step_with_attention_dropout(registered, backend, device):
    """A training step with attention dropout (p = 0.2) equals the same model on a float64
    reference that drops the same scores; and dropout changes the step."""
    transformers.AttentionInterface.register("dropout-reference", _dropout_reference)
    transformers.masking_utils.AttentionMaskInterface.register(
        "dropout-reference", transformers.masking_utils.sdpa_mask)
    loss, grads = train_step(backend, device, attention_dropout=0.2)
    ref_loss, ref_grads = train_step("dropout-reference", device, attention_dropout=0.2)
    plain_loss, _ = train_step(backend, device, attention_dropout=0.0)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert abs(loss - plain_loss) > 1e-4 * abs(plain_loss), "dropout had no effect"
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert abs(grads[name] - ref_grads[name]) <= 1e-4 * max(ref_grads[name], 1e-3), name


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no-padding"])
def test_gemma2_style_model_matches_eager(registered, backend, padded, device):
    """Soft-capped attention logits and alternating sliding-window layers (Gemma 2), against
    transformers' eager attention (SDPA cannot soft-cap)."""
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4,
        attn_logit_softcapping=2.0, final_logit_softcapping=None, query_pre_attn_scalar=16,
    )
    input_ids, attention_mask = left_padded_batch(device, padded)
    logits = {}
    for implementation in (backend, "eager"):
        model = build(transformers.Gemma2ForCausalLM, config, implementation, device)
        with torch.no_grad():
            logits[implementation] = model(input_ids=input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(logits[backend][real], logits["eager"][real], rtol=2e-4, atol=2e-4)


def test_mistral_style_sliding_window_matches_sdpa(registered, backend, device):
    """A sliding window shorter than the sequence, with and without a padding mask, and generation."""
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=5,
    )
    outputs = {}
    for implementation in (backend, "sdpa"):
        model = build(transformers.MistralForCausalLM, config, implementation, device)
        with torch.no_grad():
            for padded in (False, True):
                input_ids, attention_mask = left_padded_batch(device, padded)
                outputs[implementation, padded] = model(input_ids=input_ids, attention_mask=attention_mask).logits
            input_ids, attention_mask = left_padded_batch(device)
            outputs[implementation, "generate"] = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    for padded in (False, True):
        real = left_padded_batch(device, padded)[1].bool()
        torch.testing.assert_close(outputs[backend, padded][real], outputs["sdpa", padded][real], rtol=2e-4,
                                   atol=2e-4)
    assert torch.equal(outputs[backend, "generate"], outputs["sdpa", "generate"])


def test_position_bias_is_rejected_clearly(backend, device):
    """What the kernels lack (T5-style position biases) is an error, never ignored."""
    q = torch.randn(1, 2, 4, 16, device=device)
    with pytest.raises(ValueError, match="does not support position_bias"):
        common.hf._attention_forward(backend, None, q, q, q, None, position_bias=torch.zeros(2, device=device))


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no-padding"])
def test_gpt_oss_style_model_with_sinks_matches_eager(registered, backend, padded, device):
    """Attention sinks (a learned logit per head in every softmax) and alternating sliding-window
    layers (gpt-oss), against transformers' eager attention."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4, num_local_experts=2,
        num_experts_per_tok=1,
    )
    input_ids, attention_mask = left_padded_batch(device, padded)
    logits = {}
    for implementation in (backend, "eager"):
        model = build(transformers.GptOssForCausalLM, config, implementation, device)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()  # initialised to zeros: make them matter
        with torch.no_grad():
            logits[implementation] = model(input_ids=input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(logits[backend][real], logits["eager"][real], rtol=2e-4, atol=2e-4)


# FlashAttention's calling convention ("flash_<backend>"): padding masks, packed sequences and
# transformers' continuous batching, which serves only implementations named "flash...".


def test_flash_name_matches_sdpa(registered, backend, device):
    """A left-padded batch (transformers hands a (batch, length) padding mask): the logits of its
    tokens, then two greedy steps from the cache (no mask: bottom-right causal), as SDPA's."""
    input_ids, attention_mask = left_padded_batch(device)
    logits, tokens = {}, {}
    for implementation in (f"flash_{backend}", "sdpa"):
        model = tiny_llama(torch.float32, device, implementation)
        with torch.no_grad():
            logits[implementation] = model(input_ids=input_ids, attention_mask=attention_mask).logits
            tokens[implementation] = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                                    max_new_tokens=2, do_sample=False, pad_token_id=0)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[f"flash_{backend}"][real], logits["sdpa"][real], rtol=2e-4, atol=2e-4)
    assert torch.equal(tokens[f"flash_{backend}"], tokens["sdpa"])


def test_flash_name_packed_by_position_ids(registered, backend, device):
    """Padding-free input: two sequences packed into one row, their position ids starting over,
    each attending to its own tokens only (as each alone on SDPA)."""
    torch.manual_seed(2)
    first, second = torch.randint(1, 128, (1, 7), device=device), torch.randint(1, 128, (1, 5), device=device)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None].to(device)
    with torch.no_grad():
        packed = tiny_llama(torch.float32, device, f"flash_{backend}")(
            input_ids=torch.cat([first, second], 1), position_ids=positions).logits
        sdpa = tiny_llama(torch.float32, device, "sdpa")
        alone = torch.cat([sdpa(input_ids=first).logits, sdpa(input_ids=second).logits], 1)
    torch.testing.assert_close(packed, alone, rtol=2e-4, atol=2e-4)


def test_flash_name_sliding_window_matches_sdpa(registered, backend, device):
    """Mistral's sliding window through the flash convention (the window ours to apply: no 4-D
    mask), left-padded, as SDPA with transformers' windowed mask."""
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4,
    )
    input_ids, attention_mask = left_padded_batch(device)
    logits = {}
    for implementation in (f"flash_{backend}", "sdpa"):
        model = build(transformers.MistralForCausalLM, config, implementation, device)
        with torch.no_grad():
            logits[implementation] = model(input_ids=input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(logits[f"flash_{backend}"][real], logits["sdpa"][real], rtol=2e-4, atol=2e-4)


def test_flash_forward_sinks_window_softcap(backend, device):
    """The flash-convention function itself with gpt-oss's ``s_aux`` sinks, a sliding window and
    soft-capping, bottom-right causal with more keys than queries, against float64 attention.
    (transformers hands gpt-oss only the flash implementations its model lists, so no model test.)"""
    torch.manual_seed(3)
    q = torch.randn(2, 4, 5, 16, device=device)
    k, v = (torch.randn(2, 2, 9, 16, device=device) for _ in range(2))
    sinks = torch.randn(4, device=device)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = common.hf._flash_forward(backend, module, q, k, v, None, scaling=0.25, sliding_window=3, softcap=2.0,
                                      s_aux=sinks)
    qd, kd, vd = (x.double() for x in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))
    scores = 2.0 * torch.tanh(qd @ kd.transpose(-1, -2) * 0.25 / 2.0)
    position = torch.arange(5, device=device)[:, None] + 4  # bottom-right: row i at key i + Lk - Lq
    offset = position - torch.arange(9, device=device)[None]
    scores = scores.masked_fill((offset < 0) | (offset > 2), float("-inf"))  # causal, 2 keys back
    sink = sinks.double()[None, :, None, None].expand(2, 4, 5, 1)
    weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    torch.testing.assert_close(out.double(), (weights @ vd).transpose(1, 2), rtol=2e-4, atol=2e-4)
    with pytest.raises(ValueError, match="takes a \\(batch, key length\\) padding mask"):
        common.hf._flash_forward(backend, module, q, k, v, torch.ones(2, 1, 5, 9, dtype=torch.bool, device=device))


def test_flash_forward_deterministic(backend, device, monkeypatch):
    """transformers' ``deterministic`` (FlashAttention's flag; None: FLASH_ATTENTION_DETERMINISTIC=1) reaches
    ``common.attention``, whose backward it keeps bitwise reproducible; a bad value is a TypeError there."""
    q, k, v = (torch.randn(1, 2, 6, 16, device=device) for _ in range(3))
    module = torch.nn.Module()
    asked, shipped = [], common.hf.attention
    monkeypatch.setattr(common.hf, "attention", lambda *a, **kw: asked.append(kw["deterministic"]) or shipped(*a, **kw))
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    common.hf._flash_forward(backend, module, q, k, v, None)
    common.hf._flash_forward(backend, module, q, k, v, None, deterministic=True)
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    common.hf._flash_forward(backend, module, q, k, v, None)
    common.hf._flash_forward(backend, module, q, k, v, None, deterministic=False)
    assert asked == [False, True, True, False]
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        common.hf._flash_forward(backend, module, q, k, v, None, deterministic="yes")


def tiny_qwen3(dtype, device, implementation):
    """A Qwen3 (RMS-normed queries and keys, a head dim of its own) of tiny_llama's size."""
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
    )
    return build(transformers.Qwen3ForCausalLM, config, implementation, device, dtype)


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_continuous_batching_matches_generate(registered, backend, device, monkeypatch, model):
    """transformers' continuous batching (``generate_batch``: prompts of different lengths packed
    into each step, keys read from its paged cache) on flash_<backend> gives each prompt the
    tokens that greedy ``generate`` on SDPA gives it alone, through our varlen kernels and,
    where transformers hands us its cache, our paged kernels over its blocks (Llama, and Qwen3:
    the models issue 45 names)."""
    if not hasattr(transformers.LlamaForCausalLM, "generate_batch"):
        pytest.skip("this transformers has no continuous batching")
    if model == "qwen3" and not hasattr(transformers, "Qwen3ForCausalLM"):
        pytest.skip("this transformers has no Qwen3")
    tiny = {"llama": tiny_llama, "qwen3": tiny_qwen3}[model]
    from common.paged import paged_attention
    from common.varlen import varlen_attention

    calls, paged_calls, paged_route = [], [], []
    monkeypatch.setattr(common.hf, "varlen_attention", lambda *a, **k: calls.append(1) or varlen_attention(*a, **k))
    monkeypatch.setattr(common.hf, "paged_attention",
                        lambda *a, **k: paged_calls.append(1) or paged_attention(*a, **k))
    cache_pages = common.hf._cache_pages
    monkeypatch.setattr(common.hf, "_cache_pages", lambda *a: paged_route.append(1) or cache_pages(*a))
    prompts = [torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 13)]
    config = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    built = tiny(torch.float32, device, f"flash_{backend}")
    # (the cache sized here: transformers sizes it from free memory, which it may not read on a CPU; steps
    # of 8 tokens at most chunk the prompts' prefill, and blocks of 16 give a sequence two pages)
    sizes = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=8, block_size=16)
    with torch.no_grad():
        batch = built.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=sizes)
    assert calls or paged_calls, "continuous batching did not reach our kernels"
    if paged_route:  # (transformers 5.17's "paged|flash_<name>": decoding steps read the keys in its pages)
        assert paged_calls, "decoding steps did not reach our paged kernels"
    reference = tiny(torch.float32, device, "sdpa")
    for request, prompt in zip(sorted(batch), prompts):
        with torch.no_grad():
            alone = reference.generate(input_ids=torch.tensor([prompt], device=device), generation_config=config)
        assert batch[request].generated_tokens == alone[0, len(prompt):].tolist(), request


def test_static_cache_compiled_decoding_matches_sdpa(registered, backend, device, monkeypatch):
    """``generate`` over a static cache, its decoding steps compiled whole by transformers
    (``compile_config``: fullgraph; on the GPU its default, inductor with CUDA graphs,
    ``mode="reduce-overhead"``): the tokens SDPA gives eagerly, and a second call replays what the
    first compiled (a recompile is an error; an import between the calls must not invalidate a
    graph)."""
    input_ids, attention_mask = left_padded_batch(device)
    config = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0,
                                           cache_implementation="static")
    with torch.no_grad():
        expected = tiny_llama(torch.float32, device, "sdpa").generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config, disable_compile=True)
    if device == "cuda":
        config.compile_config = transformers.CompileConfig(fullgraph=True)
    else:  # (transformers compiles on accelerators only unless told; CUDA graphs need a GPU)
        config.compile_config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
        config.compile_config._compile_all_devices = True
    model = tiny_llama(torch.float32, device, backend)
    torch._dynamo.reset()
    with torch.no_grad():
        first = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        assert hasattr(model, "_compiled_call"), "transformers did not compile the decoding step"
        # (a module imported after warm-up: sys.modules grows)
        monkeypatch.setitem(sys.modules, "_imported_after_warm_up", types.ModuleType("_imported_after_warm_up"))
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    assert torch.equal(first, expected)
    assert torch.equal(again, expected)


class _PagedCache:
    """Each layer's keys and values in our paged cache (pages of 16, in order), written by
    append_kv and read by paged_attention as the model generates: in the model's dtype, or in
    float8_e4m3fn with descales fixed at the prompt (its largest magnitude per sequence and K/V head
    over 224: headroom of 2x before saturation at 448). Registered as an attention function of
    transformers; the model's own cache still hands us each step's new keys and values (its last
    positions), and only ours is attended."""

    def __init__(self, backend, fp8: bool, max_len: int, page: int = 16):
        self.backend, self.fp8, self.max_len, self.page = backend, fp8, max_len, page
        self.layers = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from common import append_kv, paged_attention

        B, H_kv, _, D = key.shape
        q_len = query.shape[2]
        new_k, new_v = key[:, :, -q_len:], value[:, :, -q_len:]
        state = self.layers.get(module.layer_idx)
        if state is None:  # the prompt: the caches and, in FP8, the descales
            pages = -(-self.max_len // self.page)
            dtype = torch.float8_e4m3fn if self.fp8 else key.dtype
            caches = [torch.zeros(B * pages, self.page, H_kv, D, device=key.device).to(dtype) for _ in range(2)]
            table = torch.arange(B * pages, dtype=torch.int32, device=key.device).view(B, pages)
            lengths = torch.zeros(B, dtype=torch.int32, device=key.device)
            descales = {}
            if self.fp8:
                descales = {name: (x.float().abs().amax(dim=(2, 3)) / 224).clamp_min(1e-8)
                            for name, x in (("k_descale", new_k), ("v_descale", new_v))}
            state = self.layers[module.layer_idx] = [caches, table, lengths, descales]
        caches, table, lengths, descales = state
        lengths = append_kv(*caches, table, lengths, new_k.contiguous(), new_v.contiguous(), backend=self.backend,
                            **descales)
        state[2] = lengths
        out = paged_attention(query, *caches, table, lengths, is_causal=True, scale=scaling,
                              enable_gqa=query.shape[1] != H_kv, backend=self.backend, **descales)
        return out.transpose(1, 2).contiguous(), None


def test_generation_from_an_fp8_paged_cache(backend, device):
    """Greedy decoding (a random-weight Llama, bfloat16, a batch of two prompts) with its keys and
    values in our FP8 paged cache (append_kv quantizing, paged_attention reading) picks the token
    our bfloat16 paged cache picks at 90% of positions or more (issue 44's bar).

    Positions are compared teacher-forced: the FP8 cache decodes the bfloat16 run's tokens one step
    at a time, so that one flipped choice does not make every later position differ. A random model's
    logits are nearly tied, and free-running generation diverges for good at its first flip (the
    figure printed beside)."""
    from transformers import AttentionInterface, DynamicCache

    torch.manual_seed(2)
    prompt = torch.randint(1, 128, (2, 12), device=device)
    new_tokens = 32 if device == "cuda" else 8  # (the interpreter: a few seconds a step)

    def model_on(fp8, tag):
        name = f"test-paged-{backend}-{'fp8' if fp8 else 'bf16'}-{tag}"
        AttentionInterface.register(name, _PagedCache(backend, fp8, 12 + new_tokens))
        model = tiny_llama(torch.bfloat16, device, "sdpa")
        model.set_attn_implementation(name)
        return model

    with torch.no_grad():
        generated = {fp8: model_on(fp8, "generate").generate(
            input_ids=prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=-1)
            for fp8 in (False, True)}
        sequence = generated[False]
        # teacher-forced: the FP8 cache decodes the bf16 run's tokens one step at a time
        model, cache, picks = model_on(True, "forced"), DynamicCache(), []
        cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        step = sequence[:, :12]
        for position in range(12, 12 + new_tokens):
            logits = model(input_ids=step, use_cache=True, **{cache_argument: cache}).logits
            picks.append(logits[:, -1].argmax(-1))
            step = sequence[:, position:position + 1]
    assert sequence.shape == generated[True].shape == (2, 12 + new_tokens)
    match = (torch.stack(picks, dim=1) == sequence[:, 12:]).float().mean().item()
    free = (generated[True][:, 12:] == sequence[:, 12:]).float().mean().item()
    print(f"FP8 paged cache ({backend}): {match:.0%} of positions pick the bf16 cache's token "
          f"(teacher-forced); free-running, {free:.0%} of generated tokens match")
    assert match >= 0.9, match
