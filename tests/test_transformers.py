"""Real clients: transformers models built from small random configs (nothing is
downloaded) run with attn_implementation="fastattn" and give what PyTorch's SDPA (or,
for Gemma 2's softcap and gpt-oss's sinks, transformers' eager attention) gives:
logits, greedy generation with a key-value cache, left-padded batched generation,
gradients of a training step, torch.compile, and continuous batching
(generate_batch). Where a mask is exactly causal (with a sliding window and padding),
the kernels get the rules, not the mask.

Skipped without PyTorch or transformers, and under the sanitizer build.
"""

import contextlib
import copy
import os
from unittest import mock

import numpy as np
import pytest

if os.environ.get("FASTATTN_SANITIZED"):     # before anything imports torch
    pytest.skip("PyTorch is not run under the sanitizer build", allow_module_level=True)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fa_hf = pytest.importorskip("fastattn.integrations.transformers")
import fastattn                                   # noqa: E402
import fastattn.torch                             # noqa: E402

NAME = fa_hf.register()
VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def llama():        # grouped-query attention: 8 query heads on 2 key/value heads
    return transformers.LlamaConfig(num_attention_heads=8, num_key_value_heads=2, **SMALL)


def gpt2():
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                   n_positions=128, attn_pdrop=0.0, resid_pdrop=0.0,
                                   embd_pdrop=0.0, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0)


def mistral():      # a sliding window shorter than the sequences
    return transformers.MistralConfig(num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=8, **SMALL)


def gemma2():       # sliding-window layers and attention logit softcapping
    return transformers.Gemma2Config(num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=16, sliding_window=8,
                                     query_pre_attn_scalar=16, attn_logit_softcapping=20.0,
                                     **SMALL)


def bert():
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
        pad_token_id=0)


def t5():           # relative position bias: an additive, learned bias
    return transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128,
                                 num_layers=2, num_heads=4, dropout_rate=0.0,
                                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=2)


# the implementation each model is compared with: sdpa, or eager where transformers'
# sdpa integration refuses the config (softcap)
DECODERS = {"llama": (llama, "sdpa"), "gpt2": (gpt2, "sdpa"),
            "mistral": (mistral, "sdpa"), "gemma2": (gemma2, "eager")}


def build(config, implementation, auto=transformers.AutoModelForCausalLM, seed=0):
    torch.manual_seed(seed)
    return auto.from_config(config, attn_implementation=implementation).eval()


def tokens(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, shape, generator=g)


def pair(maker, reference, auto=transformers.AutoModelForCausalLM):
    """The same weights as a fastattn model and a reference model."""
    ours = build(maker(), NAME, auto)
    theirs = copy.deepcopy(ours)
    theirs.set_attn_implementation(reference)
    return ours, theirs


def runs_on_fastattn(model, *args, **kwargs):
    """Whether a forward pass of ``model`` calls fastattn (natively, by its shortcut
    for plain calls, or its fallback for a learned bias with softcap or dropout)."""
    calls = []

    def counting(function):
        def counted(*a, **kw):
            calls.append(function.__name__)
            return function(*a, **kw)
        return counted

    torch_module = fa_hf._fa_torch
    with mock.patch.object(torch_module, "attention", counting(torch_module.attention)), \
            mock.patch.object(torch_module, "_unfused_attention",
                              counting(torch_module._unfused_attention)), \
            mock.patch.object(torch_module, "_plain_call",
                              counting(torch_module._plain_call)), \
            torch.no_grad():
        model(*args, **kwargs)
    return bool(calls)


def encoder_pair(maker, auto):
    """As ``pair``, skipped where this transformers' model does not dispatch through
    the AttentionInterface (BERT and T5 before transformers 5)."""
    try:
        ours, theirs = pair(maker, "sdpa", auto)
    except KeyError:
        ours = None
    if ours is None or not runs_on_fastattn(ours, **encoder_inputs(maker)):
        pytest.skip(f"transformers {transformers.__version__}: {maker.__name__} does "
                    f"not use the AttentionInterface")
    return ours, theirs


def encoder_inputs(maker):
    if maker is t5:
        return dict(input_ids=tokens(1, 5), decoder_input_ids=tokens(1, 3))
    return dict(input_ids=tokens(1, 5))


def close_logits(a, b, rtol=1e-4):
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= rtol * scale, ((a - b).abs().max().item(), scale)


# ----------------------------------------------------------------- decoder models

@pytest.mark.parametrize("model", list(DECODERS))
def test_logits_match(model):
    maker, reference = DECODERS[model]
    ours, theirs = pair(maker, reference)
    ids = tokens(2, 24)
    assert runs_on_fastattn(ours, ids)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0                                        # left padding
    with torch.no_grad():
        close_logits(ours(ids).logits, theirs(ids).logits)
        got = ours(ids, attention_mask=mask).logits
        want = theirs(ids, attention_mask=mask).logits
    close_logits(got[0], want[0])
    close_logits(got[1, 7:], want[1, 7:])                  # rows of real tokens


@pytest.mark.parametrize("model", list(DECODERS))
def test_greedy_generation_with_a_cache_gives_the_same_ids(model):
    maker, reference = DECODERS[model]
    ours, theirs = pair(maker, reference)
    prompt = tokens(1, 12)
    kw = dict(max_new_tokens=32, do_sample=False, min_new_tokens=32)
    with torch.no_grad():
        got = ours.generate(prompt, **kw)
        want = theirs.generate(prompt, **kw)
    assert got.shape == (1, 44)
    assert torch.equal(got, want)


@pytest.mark.parametrize("model", list(DECODERS))
def test_left_padded_batch_generates_as_each_alone(model):
    maker, _ = DECODERS[model]
    ours = build(maker(), NAME)
    long, short = tokens(1, 14, seed=2), tokens(1, 9, seed=3)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 5, dtype=long.dtype), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(max_new_tokens=16, do_sample=False, min_new_tokens=16)
    with torch.no_grad():
        batched = ours.generate(ids, attention_mask=mask, **kw)
        alone = [ours.generate(p, **kw) for p in (long, short)]
    assert torch.equal(batched[0], alone[0][0])
    assert torch.equal(batched[1, 5:], alone[1][0])


def assert_same_gradients(ours, theirs, rtol=1e-4):
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(ours.named_parameters(),
                                                       theirs.parameters())
             if q.grad is not None]
    assert grads and all(g is not None for _, g, _ in grads)
    scale = max(g.abs().max().item() for _, _, g in grads)
    worst = max(((a - b).abs().max().item(), n) for n, a, b in grads)
    assert worst[0] <= rtol * scale, (worst, scale)


@pytest.mark.parametrize("model", list(DECODERS))
def test_a_training_step_gives_the_same_gradients(model):
    maker, reference = DECODERS[model]
    ours, theirs = pair(maker, reference)
    ids = tokens(2, 20)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    # the first real token is predicted from a padding row, which attends to no key:
    # zeros in fastattn (and PyTorch's SDPA), a mean of the values in eager attention
    labels[0, 4] = -100
    for m in (ours, theirs):
        m.train()
        m(ids, attention_mask=mask, labels=labels).loss.backward()
    assert_same_gradients(ours, theirs)


@pytest.mark.parametrize("model", list(DECODERS))
def test_compiles_without_graph_breaks(model):
    maker, reference = DECODERS[model]
    ours, theirs = pair(maker, reference)
    ids = tokens(2, 16)
    explained = torch._dynamo.explain(ours)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        close_logits(compiled(ids).logits, theirs(ids).logits)
    torch._dynamo.reset()


def test_torch_compile_with_inductor():
    ours, theirs = pair(llama, "sdpa")
    ids = tokens(2, 16)
    compiled = torch.compile(ours)
    with torch.no_grad():
        close_logits(compiled(ids).logits, theirs(ids).logits)
    torch._dynamo.reset()


def test_bfloat16_logits():
    ours, theirs = pair(llama, "sdpa")
    ids = tokens(2, 24)
    with torch.no_grad():
        exact = theirs(ids).logits.double()
        ours.to(torch.bfloat16)
        theirs.to(torch.bfloat16)
        got, want = ours(ids).logits, theirs(ids).logits
    assert got.dtype == torch.bfloat16
    # the rest of the model runs in bfloat16 too: the two stay as close to each other
    # as each is to the float32 model
    err = (want.double() - exact).abs().max().item()
    assert (got.double() - want.double()).abs().max().item() <= 2 * err
    assert (got.double() - exact).abs().max().item() <= 2 * err


def test_a_4d_float_mask_with_large_negative_values():
    ours, theirs = pair(llama, "sdpa")
    ids = tokens(2, 10)
    allowed = torch.ones(10, 10, dtype=torch.bool).tril()
    allowed = allowed & (torch.arange(10)[None, :] != 3)        # a key nobody sees
    mask = torch.zeros(2, 1, 10, 10).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        close_logits(ours(ids, attention_mask=mask).logits,
                     theirs(ids, attention_mask=mask).logits)


def test_dropout_in_training_mode():
    config = gpt2()
    config.attn_pdrop = 0.5
    model = build(config, NAME).train()
    ids = tokens(2, 12)
    torch.manual_seed(5)
    first = model(ids).logits
    second = model(ids).logits
    assert not torch.equal(first, second)                  # dropout is applied
    first.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters()
               if p.grad is not None)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)


# ------------------------------------------------------------------ encoder models

def test_bert_with_a_padding_mask():
    ours, theirs = encoder_pair(bert, transformers.AutoModel)
    ids = tokens(2, 20)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0                                       # right padding
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).last_hidden_state
        want = theirs(ids, attention_mask=mask).last_hidden_state
    close_logits(got, want)
    g = torch.Generator().manual_seed(4)
    weights = torch.randn(got.shape, generator=g)
    for m in (ours, theirs):
        m.train()
        (m(ids, attention_mask=mask).last_hidden_state * weights).sum().backward()
    assert_same_gradients(ours, theirs)
    assert torch._dynamo.explain(ours.eval())(ids, attention_mask=mask).graph_break_count == 0
    torch._dynamo.reset()


def test_t5_relative_position_bias_and_its_gradient():
    ours, theirs = encoder_pair(t5, transformers.AutoModelForSeq2SeqLM)
    ids, labels = tokens(2, 14), tokens(2, 9, seed=7)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    with torch.no_grad():
        close_logits(ours(ids, attention_mask=mask, labels=labels).logits,
                     theirs(ids, attention_mask=mask, labels=labels).logits)
    for m in (ours, theirs):
        m.train()
        m(ids, attention_mask=mask, labels=labels).loss.backward()
    assert_same_gradients(ours, theirs)
    bias = ours.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert bias.grad.abs().max() > 0


def test_register_returns_the_name_and_checks_it():
    assert fa_hf.register("fastattn-test") == "fastattn-test"
    model = build(llama(), "sdpa")
    model.set_attn_implementation("fastattn-test")
    assert model.config._attn_implementation == "fastattn-test"
    with pytest.raises(TypeError):
        fa_hf.register(3)


def test_register_keeps_transformers_decode_path_decision_for_other_names():
    """register() wraps transformers' decision on its decode fast path once (calling it
    again wraps nothing more): a model on a registered name whose every layer takes a
    block table keeps it; transformers' own implementations, and a model with
    sliding-window layers, get transformers' decision (off on the CPU)."""
    from transformers.generation.continuous_batching import initialization as init
    fa_hf.register()
    decide = init.ensure_decode_fast_path_is_available
    fa_hf.register()
    assert init.ensure_decode_fast_path_is_available is decide
    assert decide._keeps_fastattn and not hasattr(decide.__wrapped__, "_keeps_fastattn")

    def blocks_kept(config, implementation):
        config._attn_implementation = implementation
        batching = transformers.ContinuousBatchingConfig(max_blocks_per_request=8)
        decide(config, batching, True)
        return batching.max_blocks_per_request

    assert blocks_kept(llama(), NAME) == 8
    assert blocks_kept(llama(), "sdpa") == 0
    assert blocks_kept(mistral(), NAME) == 0                # sliding-window layers


# ------------------------------------------- attention sinks (gpt-oss's s_aux)

def gpt_oss():      # sinks, a sliding-window layer (window 6) and a full one, MoE
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)


def sdpa_with_sinks(module, query, key, value, attention_mask, dropout=0.0,
                    scaling=None, is_causal=None, s_aux=None, sliding_window=None,
                    **kwargs):
    """PyTorch's SDPA with the sinks as one more key: a zero key and value whose
    score is the sink (an extra column of the additive mask). transformers refuses
    its own SDPA integration for gpt-oss (which would drop the sinks)."""
    B, H, Lq, E = query.shape
    Lk, groups = key.shape[2], H // key.shape[1]
    k = torch.cat([key.repeat_interleave(groups, 1), key.new_zeros(B, H, 1, E)], 2)
    v = torch.cat([value.repeat_interleave(groups, 1),
                   value.new_zeros(B, H, 1, value.shape[-1])], 2)
    if attention_mask is None:
        i = torch.arange(Lq)[:, None] + (Lk - Lq)
        attention_mask = (torch.arange(Lk)[None] <= i) if Lq > 1 else \
            torch.ones(Lq, Lk, dtype=torch.bool)
    bias = torch.zeros(attention_mask.shape, dtype=query.dtype).masked_fill(
        ~attention_mask, float("-inf")).expand(B, H, Lq, Lk)
    sink = s_aux.to(query.dtype).reshape(1, H, 1, 1).expand(B, H, Lq, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k, v, attn_mask=torch.cat([bias, sink], -1), dropout_p=dropout,
        scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def gpt_oss_models():
    """The same weights as a fastattn, an eager and an SDPA-with-sinks model; the
    sinks drawn large enough to matter (gpt-oss initialises them near 0)."""
    transformers.AttentionInterface.register("torch-sinks", sdpa_with_sinks)
    transformers.masking_utils.AttentionMaskInterface.register(
        "torch-sinks", transformers.masking_utils.sdpa_mask)
    ours = build(gpt_oss(), NAME)
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    models = [ours]
    for implementation in ("eager", "torch-sinks"):
        models.append(copy.deepcopy(ours))
        models[-1].set_attn_implementation(implementation)
    return models


def test_gpt_oss_matches_eager_with_sinks():
    """Logits (float32, 1e-5 relative), every gradient of a training step, the sinks'
    included (1e-4), and greedy generation; transformers passes the sinks as s_aux."""
    ours, eager, _ = gpt_oss_models()
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [6, None]
    ids = tokens(2, 16)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0                                        # left padding
    with torch.no_grad():
        close_logits(ours(ids).logits, eager(ids).logits, rtol=1e-5)
        got = ours(ids, attention_mask=mask).logits
        want = eager(ids, attention_mask=mask).logits
    close_logits(got[0], want[0], rtol=1e-5)
    close_logits(got[1, 5:], want[1, 5:], rtol=1e-5)
    labels = ids.masked_fill(mask == 0, -100)
    for m in (ours, eager):
        m.train()
        m(ids, attention_mask=mask, labels=labels).loss.backward()
    assert_same_gradients(ours, eager, rtol=1e-4)
    sinks = [p for n, p in ours.named_parameters() if n.endswith("self_attn.sinks")]
    assert len(sinks) == 2 and all(p.grad.abs().max() > 1e-4 for p in sinks)
    prompt = tokens(1, 8, seed=4)
    kw = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    with torch.no_grad():
        assert torch.equal(ours.eval().generate(prompt, **kw),
                           eager.eval().generate(prompt, **kw))


def test_gpt_oss_bfloat16_is_as_close_to_eager_as_pytorch_sdpa():
    """In bfloat16 fastattn differs from eager attention by no more than 1.5 times
    what PyTorch's SDPA (with the sinks as an extra key) differs from it (measured:
    1 to 1.25 times over eight seeds; dropping the sinks is 40 % of the logits)."""
    models = gpt_oss_models()
    ids = tokens(2, 24)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        ours, eager, sdpa = (m.to(torch.bfloat16)(ids, attention_mask=mask).logits
                             for m in models)
    assert ours.dtype == torch.bfloat16

    def error(a):
        d = (a.double() - eager.double()).abs()
        return max(d[0].max().item(), d[1, 5:].max().item())

    assert 0 < error(sdpa) < 0.05 * eager.abs().max().item()
    assert error(ours) <= 1.5 * error(sdpa), (error(ours), error(sdpa))


# -------------------------------------------------- keywords fastattn does not know

def attention_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 5, 16, generator=g)
    kv = torch.randn(1, 2, 5, 16, generator=g)
    module = torch.nn.Module()
    module.is_causal = True
    return module, q, kv, kv.clone()


@pytest.mark.parametrize("name, value", [
    ("indices", torch.zeros(1, 5, 2, dtype=torch.long)),      # sparse attention
    ("sinks", torch.zeros(1, 4, 5, 1)),                      # per-token sinks
    ("block_indices", torch.zeros(2, dtype=torch.long)),
    ("seq_idx", torch.zeros(1, 5, dtype=torch.int32)),
    ("something_new", 1.0),
])
def test_an_unknown_keyword_is_refused(name, value):
    module, q, k, v = attention_inputs()
    with pytest.raises(NotImplementedError, match=name):
        fa_hf.attention_forward(module, q, k, v, None, **{name: value})
    fa_hf.attention_forward(module, q, k, v, None, **{name: None})   # None: nothing


def test_keywords_that_do_not_change_the_result_are_accepted():
    module, q, k, v = attention_inputs()
    want = fa_hf.attention_forward(module, q, k, v, None)[0]
    harmless = dict(position_ids=torch.arange(5)[None], cache_position=torch.arange(5),
                    use_cache=True, output_hidden_states=True,
                    output_router_logits=False, num_items_in_batch=torch.tensor(7),
                    deterministic=True, max_length_q=5, max_length_k=5,
                    read_index=[torch.arange(5)], write_index=[torch.arange(5)],
                    logits_indices=torch.tensor([4]),
                    logits_processor_args=torch.zeros(0, 1, dtype=torch.int32),
                    sliding_window=64, output_attentions=False)
    assert set(harmless) - {"sliding_window"} == set(fa_hf.IGNORED_KEYWORDS)
    got = fa_hf.attention_forward(module, q, k, v, None, **harmless)[0]
    assert torch.equal(got, want)


def test_s_aux_runs_as_sinks_with_a_gradient():
    module, q, k, v = attention_inputs()
    s_aux = torch.tensor([1.0, -2.0, 0.5, 3.0], requires_grad=True)
    out, weights = fa_hf.attention_forward(module, q, k, v, None, s_aux=s_aux,
                                           scaling=0.25)
    assert weights is None
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    module.num_key_value_groups, module.sinks = 2, s_aux
    mask = torch.zeros(5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(),
                                         float("-inf"))
    want = eager_attention_forward(module, q, k, v, mask[None, None], scaling=0.25)[0]
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got, = torch.autograd.grad(out, s_aux, g)
    expected, = torch.autograd.grad(want, s_aux, g)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_output_attentions_warns_as_sdpa_does(caplog):
    ours = build(llama(), NAME)
    fa_hf.logger.warning_once.cache_clear()
    with caplog.at_level("WARNING"), torch.no_grad():
        ours(tokens(1, 6), output_attentions=True)
    assert any("does not support `output_attentions=True`" in r.getMessage()
               for r in caplog.records)


# ------------------------------------- masks as descriptions: the fused sliding window

def gemma3():       # sliding and full layers, no softcap
    return transformers.Gemma3TextConfig(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
        **SMALL)


def qwen2():        # use_sliding_window: the layers from max_window_layers on slide
    return transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=2,
                                    use_sliding_window=True, sliding_window=8,
                                    max_window_layers=1, **SMALL)


# the model, its reference implementation, and the windows its layers run with:
# transformers' window W lets a query see itself and the W - 1 keys before it
SLIDING = {"mistral": (mistral, "sdpa", {(7, 0)}),
           "gemma2": (gemma2, "eager", {(7, 0), None}),
           "gemma3": (gemma3, "sdpa", {(7, 0), None}),
           "qwen2": (qwen2, "sdpa", {(7, 0), None}),
           "gpt_oss": (gpt_oss, "eager", {(5, 0), None})}


@contextlib.contextmanager
def recorded_calls():
    """The keywords of every call of fastattn.torch.attention made meanwhile, with the
    shapes of its q and k, of every call of attention_varlen the integration makes for
    packed sequences (``packed`` True, with the sequences' query and key counts), and
    of every call of attention_paged it makes (``paged`` True: a decoding step over
    transformers' paged cache, with q's shape and the sequences' key counts)."""
    calls = []
    attention = fa_hf._fa_torch.attention
    varlen = fa_hf._attention_varlen

    def recorded(q, k, v, **kw):
        calls.append(dict(kw, q_shape=tuple(q.shape), k_shape=tuple(k.shape)))
        return attention(q, k, v, **kw)

    def recorded_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
        calls.append(dict(kw, packed=True, q_lengths=np.diff(cu_seqlens_q).tolist(),
                          k_lengths=np.diff(cu_seqlens_k).tolist()))
        return varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)

    def recorded_paged(q, k_cache, v_cache, block_table, kv_lengths, **kw):
        calls.append(dict(kw, paged=True, q_shape=tuple(q.shape),
                          k_lengths=kv_lengths.tolist()))
        return paged(q, k_cache, v_cache, block_table, kv_lengths, **kw)

    paged = fa_hf._attention_paged
    with mock.patch.object(fa_hf._fa_torch, "attention", recorded), \
            mock.patch.object(fa_hf, "_attention_varlen", recorded_varlen), \
            mock.patch.object(fa_hf, "_attention_paged", recorded_paged):
        yield calls


def assert_fused(calls, windows):
    """Every call got the rules, not a mask: bottom-right causal, the layers' windows,
    and at most a (B, 1, 1, Lk) vector of the keys that are not padding."""
    assert calls
    for call in calls:
        if call.get("paged"):               # (attention_paged: True is bottom-right)
            assert call["causal"] is True
            continue
        assert call["causal"] == "bottom_right"
        if call.get("packed"):
            assert "mask" not in call and "bias" not in call
            continue
        assert call["bias"] is None
        mask = call["mask"]
        keys = (call["q_shape"][0], 1, 1, call["k_shape"][2])
        assert mask is None or mask.shape == keys
    assert {call["window"] for call in calls} == windows


@pytest.mark.parametrize("model", list(SLIDING))
def test_the_sliding_window_runs_fused_with_the_reference_logits(model):
    maker, reference, windows = SLIDING[model]
    ours, theirs = pair(maker, reference)
    ids = tokens(2, 24)
    mask = torch.ones_like(ids)
    mask[0, 20:] = 0                                       # right padding
    mask[1, :5] = 0                                        # left padding
    with torch.no_grad(), recorded_calls() as calls:
        close_logits(ours(ids).logits, theirs(ids).logits)
        assert_fused(calls, windows)
        assert all(call["mask"] is None for call in calls)
        calls.clear()
        got = ours(ids, attention_mask=mask).logits
        want = theirs(ids, attention_mask=mask).logits
        assert_fused(calls, windows)
        assert all(call["mask"] is not None for call in calls)
    close_logits(got[0, :20], want[0, :20])                # rows of real tokens
    close_logits(got[1, 5:], want[1, 5:])


@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_padded_decoding_with_a_dynamic_cache(model):
    """Left and right padding, prefill and then decoding token by token with a
    DynamicCache (Mistral's keeps only the window), against SDPA: the logits of every
    step and the greedy ids. Right padding leaves padding between the prompt and the
    generated tokens: the keys' vector describes it, lengths could not."""
    maker, _ = DECODERS[model]
    windows = SLIDING[model][2] if model in SLIDING else {None}
    ours, theirs = pair(maker, "sdpa")
    ids = tokens(2, 20, seed=5)
    mask = torch.ones_like(ids)
    mask[0, 16:] = 0
    mask[1, :6] = 0
    caches = [transformers.DynamicCache(config=m.config) for m in (ours, theirs)]

    def greedy(logits, step):       # after each row's last real token
        last = logits[:, -1] if step else torch.stack([logits[0, 15], logits[1, -1]])
        return last.argmax(-1, keepdim=True)

    chosen = []
    with torch.no_grad(), recorded_calls() as calls:
        for step in range(12):
            got, want = (m(ids, attention_mask=mask, cache=c, use_cache=True).logits
                         for m, c in zip((ours, theirs), caches))
            rows = (slice(0, 16), slice(6, None)) if step == 0 else (slice(None),) * 2
            for b, real in enumerate(rows):
                close_logits(got[b, real], want[b, real])
            ids = greedy(got, step)
            assert torch.equal(ids, greedy(want, step))
            chosen.append(ids)
            mask = torch.cat([mask, torch.ones_like(ids)], 1)
    assert_fused(calls, windows)
    # the padding is in every mask, until Mistral's window has slid past it
    masked = [call["mask"] is not None for call in calls]
    assert all(masked) if model == "llama" else masked[0] and not masked[-1]
    assert any(call["q_shape"][2] == 1 for call in calls)
    assert len(set(torch.cat(chosen, 1)[0].tolist())) > 1


def allowed_by_fastattn(description, batch):
    """The (B, 1, Lq, Lk) pairs fastattn's kernels allow under a description: the
    weights of all-zero queries and keys are positive exactly there."""
    q = np.zeros((batch, 1, description.q_length, 4))
    k = np.zeros((batch, 1, description.kv_length, 4))
    keys = description.key_mask
    weights = fastattn.attention_weights(
        q, k, causal="bottom_right", window=description.window,
        mask=None if keys is None else keys.numpy())
    return torch.from_numpy(weights > 0)


PADDINGS = {"none": None,
            "left": lambda n: torch.arange(n) >= 3,
            "right": lambda n: torch.arange(n) < n - 2,
            "holes": lambda n: torch.arange(n) % 4 != 1}


@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize("q_length, kv_length, q_offset, kv_offset", [
    (12, 12, 0, 0),           # prefill
    (1, 12, 11, 0),           # decoding with a cache
    (4, 12, 8, 0),            # a chunk of a prompt over a cache
    (1, 8, 12, 5),            # a sliding-window cache that holds only the window
    (5, 9, 10, 6),
])
def test_a_description_allows_exactly_what_sdpa_mask_allows(
        q_length, kv_length, q_offset, kv_offset, window, padding):
    functions = transformers.masking_utils
    rule = (functions.causal_mask_function if window is None
            else functions.sliding_window_causal_mask_function(window))
    seen = kv_offset + kv_length
    padded = PADDINGS[padding]
    attention_mask = None
    if padded is not None:
        attention_mask = torch.stack([padded(seen), torch.ones(seen, dtype=torch.bool)])
    args = dict(batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=rule, attention_mask=attention_mask,
                local_size=window)
    description = fa_hf.build_mask(**args)
    assert isinstance(description, fa_hf.MaskDescription)
    want = functions.sdpa_mask(**args, allow_is_causal_skip=False)
    assert torch.equal(allowed_by_fastattn(description, 2), want.expand(2, 1, -1, -1))


def test_a_mask_it_cannot_describe_is_transformers_own():
    functions = transformers.masking_utils
    padding = torch.arange(12)[None] >= 2
    base = dict(batch_size=1, q_length=12, kv_length=12, attention_mask=padding)
    others = [
        dict(mask_function=functions.chunked_causal_mask_function(
            4, torch.zeros(1, dtype=int))),
        dict(mask_function=functions.or_masks(functions.causal_mask_function,
                                              lambda b, h, q, kv: kv == 0)),
        dict(allow_is_causal_skip=False),                  # the caller wants a tensor
        dict(q_offset=torch.tensor(0)),                    # a StaticCache's offset
        dict(q_length=1, q_offset=3),                      # a StaticCache: keys to come
        dict(mask_function=functions.bidirectional_mask_function),
    ]
    for other in others:
        args = dict(base, **other)
        got = fa_hf.build_mask(**args)
        assert isinstance(got, torch.Tensor), other
        assert torch.equal(got, functions.sdpa_mask(**args))


def test_packed_sequences_in_position_ids_get_the_mask():
    """Sequences packed in one row (the positions restart): transformers' mask, which
    keeps them apart, reaches the kernels, and the logits are SDPA's."""
    ours, theirs = pair(mistral, "sdpa")
    ids = tokens(1, 20)
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with torch.no_grad(), recorded_calls() as calls:       # no cache: training-like
        got = ours(ids, position_ids=positions, use_cache=False).logits
        want = theirs(ids, position_ids=positions, use_cache=False).logits
    close_logits(got, want)
    with torch.no_grad():                                  # the packing matters
        assert not torch.allclose(got, ours(ids, use_cache=False).logits, atol=1e-3)
    assert all(call["mask"].shape == (1, 1, 20, 20) and call["window"] is None
               for call in calls)


def test_a_description_for_other_lengths_is_refused():
    module, q, k, v = attention_inputs()
    description = fa_hf.MaskDescription(q_length=5, kv_length=6)
    with pytest.raises(ValueError, match="built for 5 queries and 6 keys"):
        fa_hf.attention_forward(module, q, k, v, description)


# ------------------------------------------------------------ continuous batching

def continuous_batching_ids(model, implementation):
    """The greedy ids of three prompts of different lengths by ``generate_batch``
    (transformers' continuous batching, its paged cache) on ``implementation``."""
    model.set_attn_implementation(implementation)
    config = transformers.GenerationConfig(max_new_tokens=8, do_sample=False,
                                           eos_token_id=2, pad_token_id=0)
    batching = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64,
                                                     page_size=16)
    prompts = [tokens(5, seed=6).tolist(), tokens(3, seed=7).tolist(),
               tokens(9, seed=8).tolist()]
    with torch.no_grad():
        out = model.generate_batch(prompts, generation_config=config,
                                   continuous_batching_config=batching)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


@pytest.mark.parametrize("model, reference, windows", [
    ("llama", "sdpa", {None}),
    ("mistral", "sdpa", {(7, 0)}),
    ("gpt_oss", "eager", {(5, 0), None}),        # sinks; transformers: paged|eager
])
def test_continuous_batching_gives_the_reference_ids(model, reference, windows):
    """generate_batch on fastattn gives the reference implementation's ids: prefill
    steps (and, for models with sliding-window layers, every step) are one call of
    attention_varlen over the keys transformers gathers; a model whose every layer's
    cache takes a block table decodes over transformers' paged cache in place, one
    attention_paged call per layer and step."""
    maker = {"llama": llama, "mistral": mistral, "gpt_oss": gpt_oss}[model]
    ours = build(maker(), NAME)
    want = continuous_batching_ids(copy.deepcopy(ours), reference)
    with recorded_calls() as calls:
        got = continuous_batching_ids(ours, NAME)
    assert got == want
    assert ours.config._attn_implementation == NAME
    # in evaluation, one call of the kernels per layer and step for all the sequences,
    # on views of the packed tensors: no mask, each sequence's queries its last tokens,
    # the layer's window
    assert_fused(calls, windows)
    in_pages = [call for call in calls if call.get("paged")]
    packed = [call for call in calls if call.get("packed")]
    assert len(in_pages) + len(packed) == len(calls)
    pairs = [(nq, nk) for call in packed
             for nq, nk in zip(call["q_lengths"], call["k_lengths"])]
    assert any(nq > 1 for nq, nk in pairs)                          # prefill
    assert any(len(call["q_lengths"]) > 1 for call in packed)       # a batch
    if model == "llama":
        # decoding over the pages in place: one new query per sequence
        assert in_pages and all(call["q_shape"][1] == 1 for call in in_pages)
        assert any(len(call["k_lengths"]) > 1 for call in in_pages)
    else:                   # sliding-window layers: transformers gathers the keys
        assert not in_pages
        assert any(nk > nq == 1 for nq, nk in pairs)                # decoding


def eager_packed(q, k, v, sequences, causal, window, sinks=None):
    """Packed sequences' attention in float64 PyTorch arithmetic with explicit masks:
    sequence (q0, q1, k0, k1) of q (1, Hq, Lq, E) attends to keys k0:k1 of k, v
    (1, Hkv, Lk, E), its queries its last tokens; window (left, right) in positions.
    With ``sinks`` (Hq,), one logit per head joins each row's softmax, carrying no
    value. Returns (1, Lq, Hq, E), zeros in rows no sequence owns and in rows with no
    key."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    out = torch.zeros(1, q.shape[2], q.shape[1], v.shape[-1], dtype=torch.float64)
    for q0, q1, k0, k1 in sequences:
        rows = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        d = torch.arange(k1 - k0)[None, :] - rows                  # key - query
        allowed = (d >= -window[0]) & (d <= window[1])
        if causal:
            allowed &= d <= 0
        s = q[:, :, q0:q1].double() @ k[:, :, k0:k1].transpose(-1, -2)
        s = s / q.shape[-1] ** 0.5
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        if sinks is not None:
            sink = sinks.double()[None, :, None, None].expand(*s.shape[:-1], 1)
            p = torch.softmax(torch.cat([s, sink], -1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        p = p * allowed.any(-1, keepdim=True)       # a row with no key: zeros
        out[:, q0:q1] = (p @ v[:, :, k0:k1]).transpose(1, 2)
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("grad", [False, True])
def test_packed_sequences_follow_the_varlen_rules(causal, grad):
    """FlashAttention's varlen rules: each sequence's queries are its last tokens, and
    a window of 2 spans one key on each side (the causal rule cuts the right one); in
    evaluation one call of attention_varlen for all the sequences, with a gradient to
    record one call of the operator per sequence, whose gradients are those of the
    float64 recomputation. Without the causal rule each sequence has as many queries
    as keys (see the test after this one)."""
    module, q, k, v = attention_inputs(seed=4)
    q, k, v = (torch.cat([x, x.flip(2)], 2)[:, :, :9 if x is q else 10]
               .requires_grad_(grad) for x in (q, k, v))
    cu_q = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 10], dtype=torch.int32)
    sequences = [(0, 3, 0, 5), (3, 4, 5, 7), (4, 8, 7, 10)]
    if not causal:
        cu_k = cu_q
        sequences = [(0, 3, 0, 3), (3, 4, 3, 4), (4, 8, 4, 8)]
    with recorded_calls() as calls:
        got, _ = fa_hf.attention_forward(module, q, k, v, None, is_causal=causal,
                                         sliding_window=2, cu_seq_lens_q=cu_q,
                                         cu_seq_lens_k=cu_k, max_length_q=4,
                                         max_length_k=5)
    assert got.shape == (1, 9, 4, 16)
    assert [call.get("packed", False) for call in calls] == ([False] * 3 if grad
                                                             else [True])
    want = eager_packed(q, k, v, sequences, causal, (1, 1))
    torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=2e-6)
    assert torch.equal(got[:, 8:], torch.zeros(1, 1, 4, 16))   # past the last sequence
    if grad:
        g = torch.randn(got.shape, generator=torch.Generator().manual_seed(5))
        ours = torch.autograd.grad(got, (q, k, v), g)
        theirs = torch.autograd.grad(want, (q, k, v), g.double())
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sliding_window, refused", [(2, True), (12, False)])
def test_packed_sequences_refuse_a_window_they_would_place_differently(
        sliding_window, refused):
    """Without the causal rule a packed sequence of fewer queries than keys would sit
    at its first positions in fastattn's window, at its last in FlashAttention's: where
    the window can bind, the call is refused, naming the counts; where it cannot, the
    result is the float64 recomputation's."""
    module, q, k, v = attention_inputs(seed=7)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 2, 5], dtype=torch.int32)
    q = q[:, :, :4]
    cu_q[2] = 4                                      # 2 queries over 3 keys
    keywords = dict(is_causal=False, sliding_window=sliding_window, cu_seq_lens_q=cu_q,
                    cu_seq_lens_k=cu_k)
    if refused:
        with pytest.raises(NotImplementedError, match="2 queries, 3 keys"):
            fa_hf.attention_forward(module, q, k, v, None, **keywords)
        return
    got, _ = fa_hf.attention_forward(module, q, k, v, None, **keywords)
    want = eager_packed(q, k, v, [(0, 2, 0, 2), (2, 4, 2, 5)], False, (11, 11))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)


def test_packed_bfloat16_sequences_without_ml_dtypes(monkeypatch):
    """bfloat16 without ml_dtypes: the NumPy views are float32 copies, and the one call
    still gives bfloat16 rows, those of the float64 recomputation within bfloat16's
    rounding."""
    module, q, k, v = attention_inputs(seed=6)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    monkeypatch.setattr(fa_hf._fa_torch, "_BFLOAT16", None)
    with torch.no_grad(), recorded_calls() as calls:
        got, _ = fa_hf.attention_forward(module, q, k, v, None, is_causal=True,
                                         cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert [call.get("packed", False) for call in calls] == [True]
    assert got.dtype == torch.bfloat16
    want = eager_packed(q, k, v, [(0, 2, 0, 2), (2, 5, 2, 5)], True, (99, 99))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-2)


def paged_layer(seed=8, S=3, page=4, Hkv=2, E=16):
    """A layer's decoding step over a paged cache as transformers' continuous batching
    hands it over with a block table: pages in random order (-1 past each sequence's
    pages), each sequence's key count including its new token."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(12, page, Hkv, E, generator=g)
    v_cache = torch.randn(12, page, Hkv, E, generator=g)
    lengths = torch.tensor([6, 1, 9])[:S]
    order = torch.randperm(12, generator=g)
    table = torch.full((S, 4), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lengths.tolist()):
        need = (n + page - 1) // page
        table[s, :need] = order[used:used + need].to(torch.int32)
        used += need
    q = torch.randn(1, 4, S, E, generator=g)
    k = torch.randn(1, Hkv, S, E, generator=g)
    v = torch.randn(1, Hkv, S, E, generator=g)
    cu_q = torch.arange(S + 1, dtype=torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    cu_k = cu_k.to(torch.int32)
    return q, k, v, k_cache, v_cache, table, lengths, cu_q, cu_k


@pytest.mark.parametrize("sinks", [False, True])
def test_a_decoding_step_reads_and_writes_transformers_pages_in_place(sinks):
    """With a block table (transformers' decode fast path), each sequence's new key
    and value rows land at its position in its pages and nowhere else, and its query
    attends to its pages (with the layer's sinks): the float64 recomputation over the
    keys gathered from the expected cache."""
    module, *_ = attention_inputs()
    s_aux = torch.tensor([0.5, -1.0, 2.0, 0.0]) if sinks else None
    q, k, v, k_cache, v_cache, table, lengths, cu_q, cu_k = paged_layer()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    page = k_cache.shape[1]
    for s, n in enumerate(lengths.tolist()):
        block, row = int(table[s, (n - 1) // page]), (n - 1) % page
        want_k[block, row], want_v[block, row] = k[0, :, s], v[0, :, s]
    with torch.no_grad():
        out, weights = fa_hf.attention_forward(
            module, q, k, v, None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
            block_table=table, k_cache=k_cache, v_cache=v_cache, max_length_q=1,
            max_length_k=9, s_aux=s_aux)
    assert weights is None and out.shape == (1, 3, 4, 16)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    for s, n in enumerate(lengths.tolist()):
        blocks = table[s, :(n + page - 1) // page].long()
        keys = want_k[blocks].reshape(-1, 2, 16)[:n].transpose(0, 1)[None]
        values = want_v[blocks].reshape(-1, 2, 16)[:n].transpose(0, 1)[None]
        ref = eager_packed(q[:, :, s:s + 1], keys, values, [(0, 1, 0, n)], True,
                           (n, 0), s_aux)
        torch.testing.assert_close(out[:, s:s + 1].double(), ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("change, error, match", [
    (dict(k_cache=None), NotImplementedError, r"\['k_cache'\] missing"),
    (dict(cu_seq_lens_q=torch.tensor([0, 2, 3], dtype=torch.int32)),
     NotImplementedError, "one new token per sequence"),
    (dict(attention_mask=torch.ones(1, 1, 3, 16, dtype=torch.bool)),
     NotImplementedError, "attention mask"),
    (dict(cu_seq_lens_k=torch.tensor([0, 6, 6, 15], dtype=torch.int32)),
     ValueError, "at least its new token"),
    (dict(cu_seq_lens_k=torch.tensor([0, 6, 7], dtype=torch.int32)),
     ValueError, "at least its new token"),
    (dict(cu_seq_lens_k=torch.tensor([0, 6, 7, 24], dtype=torch.int32)),
     ValueError, "more than the block table's 4 pages"),
    (dict(grad=True), NotImplementedError, "inference only"),
    (dict(cu_seq_lens_q=torch.tensor([0, 1, 1, 2], dtype=torch.int32)),
     NotImplementedError, "one new token per sequence"),
    (dict(cu_seq_lens_k=torch.tensor([0, 6, 7, 20], dtype=torch.int32)),
     ValueError, r"block_table\[2, 3\] = -1: no page for sequence 2"),
])
def test_a_paged_step_refuses_what_it_cannot_compute(change, error, match):
    """Nothing written where a paged step cannot be computed as asked: a missing page
    view, prefill (several new tokens), a mask, a sequence without its new token (or
    without its offsets), one longer than its block table, a gradient to record, a gap
    in the packed queries, a new token with no page in the table."""
    module, *_ = attention_inputs()
    q, k, v, k_cache, v_cache, table, lengths, cu_q, cu_k = paged_layer()
    before = k_cache.clone(), v_cache.clone()
    kw = dict(attention_mask=None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
              block_table=table, k_cache=k_cache, v_cache=v_cache)
    change = dict(change)
    if change.pop("grad", False):
        q.requires_grad_(True)
    kw.update(change)
    mask = kw.pop("attention_mask")
    with pytest.raises(error, match=match):
        fa_hf.attention_forward(module, q, k, v, mask, **kw)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_a_padded_paged_step_gives_zeros_past_its_sequences():
    """Static shapes (transformers pads a decoding batch where it compiles): sequences
    of no new token after the last one, and query rows past it, are not written to the
    pages and come back as zeros; the others as without the padding."""
    module, *_ = attention_inputs()
    q, k, v, k_cache, v_cache, table, lengths, cu_q, cu_k = paged_layer()

    def pad(x):                 # two rows past the last sequence
        return torch.cat([x, torch.randn(1, x.shape[1], 2, 16)], 2)

    unused = torch.full((2, 4), -1, dtype=table.dtype)
    padded = dict(cu_seq_lens_q=torch.tensor([0, 1, 2, 3, 3, 3], dtype=torch.int32),
                  cu_seq_lens_k=torch.cat([cu_k, cu_k[-1:], cu_k[-1:]]),
                  block_table=torch.cat([table, unused]))
    caches = k_cache.clone(), v_cache.clone()
    with torch.no_grad():
        want, _ = fa_hf.attention_forward(module, q, k, v, None, cu_seq_lens_q=cu_q,
                                          cu_seq_lens_k=cu_k, block_table=table,
                                          k_cache=k_cache, v_cache=v_cache)
        got, _ = fa_hf.attention_forward(module, pad(q), pad(k), pad(v), None,
                                         k_cache=caches[0], v_cache=caches[1],
                                         **padded)
    assert got.shape == (1, 5, 4, 16)
    assert torch.equal(got[:, :3], want) and not got[:, 3:].any()
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)
