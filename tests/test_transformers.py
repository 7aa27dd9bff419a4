"""Real clients: transformers models built from small random configs (nothing is
downloaded) run with attn_implementation="fastattn" and give what PyTorch's SDPA (or,
for Gemma 2's softcap, transformers' eager attention) gives: logits, greedy generation
with a key-value cache, left-padded batched generation, gradients of a training step,
and torch.compile.

Skipped without PyTorch or transformers, and under the sanitizer build.
"""

import copy
import os
from unittest import mock

import pytest

if os.environ.get("FASTATTN_SANITIZED"):     # before anything imports torch
    pytest.skip("PyTorch is not run under the sanitizer build", allow_module_level=True)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fa_hf = pytest.importorskip("fastattn.integrations.transformers")

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
