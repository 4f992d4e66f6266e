"""attn_implementation="mha_ext" in Hugging Face transformers: tiny random-init Llama (GQA),
Gemma 2 (softcap + sliding window) and gpt-oss (sinks + sliding window) models built here,
compared in float32 with transformers' own "eager" / "sdpa" for training (padding, packed
sequences, gradients), model.generate and continuous batching (generate_batch). Spies on
mha_ext.attention / attention_varlen prove which mha_ext path ran."""

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    DataCollatorWithFlattening,
    Gemma2Config,
    GenerationConfig,
    GptOssConfig,
    LlamaConfig,
)
from transformers.generation.continuous_batching import ContinuousBatchingManager  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    AttentionMaskInterface,
    causal_mask_function,
    chunked_causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

import mha_ext  # noqa: E402
import mha_ext.integrations.transformers as hf  # noqa: E402

from conftest import seeded_generator  # noqa: E402

hf.register()

VOCAB = 97
WINDOW = 4  # shorter than every sequence below, so the sliding layers drop keys
KINDS = ("llama", "gemma2", "gpt_oss")
# float32 end to end: logits and gradients agree with eager's to rounding (measured max
# relative error ~1e-6 here); 1e-5 of the largest magnitude leaves room for the summation order.
TOLERANCE = 1e-5


def tiny_config(kind, **overrides):
    """2 layers, hidden 64, 4 query heads over 2 kv heads of 16 dims. initializer_range 0.3
    makes the scores large enough (several units) that softcap 2 and the sinks change them;
    untied embeddings keep greedy decoding from repeating the last token (with tied ones the
    embedding's match with itself outweighs what attention adds)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "gemma2":
        return Gemma2Config(
            **common, sliding_window=WINDOW, attn_logit_softcapping=2.0, query_pre_attn_scalar=16
        )
    return GptOssConfig(**common, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)


def model_pair(kind, reference="eager", **overrides):
    """(reference model, mha_ext model) with the same weights, each on its own config copy
    (from_config writes the implementation into the config it is given)."""
    config = tiny_config(kind, **overrides)
    torch.manual_seed(0)
    reference_model = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=reference
    )
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in reference_model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="mha_ext")
    model.load_state_dict(reference_model.state_dict())
    return reference_model, model


def assert_close(actual, expected, what):
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(
        actual, expected, rtol=TOLERANCE, atol=TOLERANCE * scale, msg=lambda m: f"{what}: {m}"
    )


def assert_same_gradients(model, reference_model):
    reference_grads = dict(reference_model.named_parameters())
    for name, parameter in model.named_parameters():
        expected = reference_grads[name].grad
        assert parameter.grad is not None and expected is not None, name
        assert_close(parameter.grad, expected, f"grad of {name}")


@pytest.fixture
def calls(monkeypatch):
    """Every mha_ext entry point the integration calls, as (function, details)."""
    record = []

    def spy(name, function):
        def wrapper(q, k, v, *args, **kwargs):
            mask = kwargs.get("attn_mask")
            record.append(
                (
                    name,
                    dict(
                        q_rows=q.shape[-2] if name == "attention" else q.shape[0],
                        kv_heads=k.shape[1],  # (B, Hkv, S, D) or packed (total, Hkv, D)
                        mask=None if mask is None else tuple(mask.shape),
                        causal=kwargs.get("causal"),
                        window=kwargs.get("window"),
                        softcap=kwargs.get("softcap"),
                        sinks=kwargs.get("sinks") is not None,
                        dropout_p=kwargs.get("dropout_p"),
                    ),
                )
            )
            return function(q, k, v, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(hf, "attention", spy("attention", hf.attention))
    monkeypatch.setattr(hf, "attention_varlen", spy("attention_varlen", hf.attention_varlen))
    return record


def assert_model_features(kind, details):
    """What every call of the model must have passed: grouped kv heads unrepeated, and each
    model's own options."""
    assert details and all(d["kv_heads"] == 2 for d in details), details
    windows = {d["window"] for d in details}
    if kind == "llama":
        assert windows == {None}
    else:  # one sliding layer (window - 1 keys before the query), one full layer
        assert windows <= {None, (WINDOW - 1, 0)} and (WINDOW - 1, 0) in windows, windows
    assert all(d["softcap"] == (2.0 if kind == "gemma2" else 0.0) for d in details)
    assert all(d["sinks"] == (kind == "gpt_oss") for d in details)


def padded_batch(padding):
    """input_ids (2, 11), attention_mask with 3 pad positions in row 0 (or None), labels.
    The labels skip every token predicted from a pad position: a query that sees no key has
    no defined output (eager averages the masked keys, mha_ext gives 0)."""
    generator = seeded_generator(1)
    input_ids = torch.randint(1, VOCAB, (2, 11), generator=generator)
    if padding is None:
        return input_ids, None, input_ids.clone()
    attention_mask = torch.ones_like(input_ids)
    if padding == "left":
        attention_mask[0, :3] = 0
    else:
        attention_mask[0, -3:] = 0
    predicted_from_pad = torch.nn.functional.pad(attention_mask[:, :-1] == 0, (1, 0))
    labels = input_ids.masked_fill((attention_mask == 0) | predicted_from_pad, -100)
    return input_ids, attention_mask, labels


TRAINING_CASES = [(kind, "eager") for kind in KINDS] + [("llama", "sdpa")]


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("kind, reference", TRAINING_CASES)
def test_training_step_matches_reference(kind, reference, padding, calls):
    reference_model, model = model_pair(kind, reference)
    input_ids, attention_mask, labels = padded_batch(padding)
    outputs = {}
    for name, m in (("reference", reference_model), ("mha_ext", model)):
        m.train()
        out = m(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        out.loss.backward()
        outputs[name] = out
    kept = slice(None) if attention_mask is None else attention_mask.bool()
    assert_close(outputs["mha_ext"].logits[kept], outputs["reference"].logits[kept], "logits")
    assert_close(outputs["mha_ext"].loss, outputs["reference"].loss, "loss")
    assert_same_gradients(model, reference_model)

    details = [d for name, d in calls if name == "attention"]
    assert len(details) == len(calls) == 2  # one fused call per layer, no varlen
    # No padding: no mask at all; padding: a (B, 1, 1, Sk) key mask, never a dense one.
    expected_mask = None if padding is None else (2, 1, 1, 11)
    assert all(d["mask"] == expected_mask and d["causal"] == "bottom_right" for d in details)
    assert_model_features(kind, details)


def packed_batch(with_flash_kwargs):
    """Three sequences (5, 9 and 3 tokens) packed into one row by DataCollatorWithFlattening."""
    generator = seeded_generator(2)
    sequences = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (5, 9, 3)]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=with_flash_kwargs)
    batch = collator([{"input_ids": s} for s in sequences])  # tensors on the CPU
    device = torch.get_default_device()
    return sequences, {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def next_token_loss(logits, labels):
    """The causal-LM loss, computed the same way for packed and separate sequences."""
    return torch.nn.functional.cross_entropy(
        logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum"
    )


@pytest.mark.parametrize("with_flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequences_run_varlen(kind, with_flash_kwargs, calls):
    """Packed training equals the reference model run on each sequence alone: logits, loss
    and gradients. (Not transformers' eager on the packed row: gpt-oss builds its masks
    without position_ids, so its eager attention crosses the sequences.)"""
    reference_model, model = model_pair(kind)
    sequences, batch = packed_batch(with_flash_kwargs)
    assert ("cu_seq_lens_q" in batch) == with_flash_kwargs
    model.train()
    packed = model(**batch, use_cache=False).logits
    next_token_loss(packed, batch["labels"]).backward()
    reference_model.train()
    alone = [reference_model(input_ids=torch.tensor([s])).logits for s in sequences]
    sum(
        next_token_loss(logits, torch.tensor([s])) for logits, s in zip(alone, sequences)
    ).backward()
    assert_close(packed, torch.cat(alone, dim=1), "packed logits vs each sequence alone")
    assert_same_gradients(model, reference_model)
    details = [d for name, d in calls if name == "attention_varlen"]
    assert len(details) == len(calls) == 2
    assert all(d["q_rows"] == 17 and d["causal"] == "bottom_right" for d in details)
    assert_model_features(kind, details)


def test_packing_is_found_from_position_ids_when_a_cache_hides_it_from_the_mask(calls):
    """With use_cache left on, transformers builds no packed mask (it only looks for packing
    without a cache); mha_ext still splits the sequences, as flash attention does."""
    _, model = model_pair("llama")
    sequences, batch = packed_batch(with_flash_kwargs=False)
    with torch.no_grad():
        packed = model(**batch).logits[0]
        alone = model(input_ids=torch.tensor([sequences[0]])).logits[0]
    assert_close(packed[:5], alone, "first packed sequence vs alone")
    assert calls[0][0] == "attention_varlen"


def test_dropout_is_mha_ext_fused_dropout(calls):
    """The attention function passes dropout on: after the same seed it equals
    mha_ext.attention with that dropout_p, and a training model's outputs reproduce."""
    module = types.SimpleNamespace(is_causal=True)
    generator = seeded_generator(3)
    q = torch.randn(2, 4, 9, 16, generator=generator)
    k, v = (torch.randn(2, 2, 9, 16, generator=generator) for _ in range(2))
    torch.manual_seed(5)
    out, weights = hf.mha_ext_attention_forward(module, q, k, v, None, dropout=0.3, scaling=0.2)
    torch.manual_seed(5)
    expected = mha_ext.attention(q, k, v, causal="bottom_right", scale=0.2, dropout_p=0.3)
    assert weights is None
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=0)
    no_dropout = mha_ext.attention(q, k, v, causal="bottom_right", scale=0.2)
    assert not torch.allclose(expected, no_dropout)

    _, model = model_pair("llama", attention_dropout=0.3)
    input_ids, _, _ = padded_batch(None)
    model.train()
    torch.manual_seed(7)
    first = model(input_ids=input_ids).logits
    torch.manual_seed(7)
    again = model(input_ids=input_ids).logits
    model.eval()
    evaluated = model(input_ids=input_ids).logits
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.allclose(first, evaluated, atol=1e-3)
    assert calls[-4][1]["dropout_p"] == 0.3 and calls[-1][1]["dropout_p"] == 0.0


GENERATE_CASES = [(kind, "eager", "dynamic") for kind in KINDS] + [
    ("llama", "sdpa", "dynamic"),
    ("gemma2", "eager", "static"),
]


@pytest.mark.parametrize("kind, reference, cache", GENERATE_CASES)
def test_generate_matches_reference(kind, reference, cache, calls):
    reference_model, model = model_pair(kind, reference)
    input_ids, attention_mask, _ = padded_batch("left")
    results = {}
    for name, m in (("reference", reference_model), ("mha_ext", model)):
        m.eval()
        results[name] = m.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            cache_implementation=cache,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert results["mha_ext"].sequences.shape == (2, 11 + 6)
    assert torch.equal(results["mha_ext"].sequences, results["reference"].sequences)
    for step, (ours, theirs) in enumerate(
        zip(results["mha_ext"].logits, results["reference"].logits)
    ):
        assert_close(ours, theirs, f"logits of generated token {step}")
    details = [d for _, d in calls]
    # A prefill of 11 queries per layer, then one query per layer and step.
    assert [d["q_rows"] for d in details] == [11, 11] + [1] * 10
    if cache == "static":
        # The full layer's static keys run past the queries: transformers' dense masks, alone.
        full_layer = details[1::2]  # Gemma 2's layers: sliding, full
        assert all(len(d["mask"]) == 4 and d["causal"] is None for d in full_layer)
    else:
        # The left padding's key mask; a sliding layer's cache soon holds no padding.
        assert all(d["mask"] is None or d["mask"][:3] == (2, 1, 1) for d in details)
        assert all(d["mask"] is not None for d in details if d["window"] is None)
    assert_model_features(kind, details)


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], list(range(11, 21))]
NEW_TOKENS = 6


def continuous_batching(model):
    """generate_batch over PROMPTS with a 16-token batch budget, so the 10-token prompt
    shares batches with the others' prefill and decode steps. [(tokens, logprobs)]"""
    generation_config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    config = ContinuousBatchingConfig(
        page_size=16,
        num_blocks=16,
        max_batch_tokens=16,
        return_logprobs=True,
        auto_switch_to_flash=False,
    )
    outputs = model.generate_batch(
        PROMPTS, generation_config=generation_config, continuous_batching_config=config
    )
    results = [outputs[f"req_{i}"] for i in range(len(PROMPTS))]
    assert all(r.error is None and len(r.generated_tokens) == NEW_TOKENS for r in results)
    return [(r.generated_tokens, torch.tensor(r.logprobs)) for r in results]


def generate_one_by_one(model):
    """model.generate (dynamic cache) on each prompt alone: [(tokens, logprobs)]."""
    results = []
    for prompt in PROMPTS:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :]
        logits = torch.cat(out.logits)  # (NEW_TOKENS, vocab)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        results.append((tokens.tolist(), logprobs))
    return results


def assert_same_generations(ours, theirs, what):
    for i, ((our_tokens, our_logprobs), (their_tokens, their_logprobs)) in enumerate(
        zip(ours, theirs)
    ):
        assert our_tokens == their_tokens, f"{what}, prompt {i}"
        assert_close(our_logprobs, their_logprobs, f"{what}, prompt {i}: log-probabilities")


CONTINUOUS_BATCHING_CASES = [(kind, "eager") for kind in KINDS] + [("llama", "sdpa")]


@pytest.mark.parametrize("kind, reference", CONTINUOUS_BATCHING_CASES)
def test_continuous_batching_matches_reference(kind, reference, calls):
    """transformers serves "mha_ext" as it is (it writes the paged cache, then passes the
    sequences' keys packed with cu_seq_lens): the same tokens and log-probabilities as the
    reference's model.generate on each prompt, and as transformers' own continuous batching
    of the reference, except for Gemma 2, where transformers 5.24's paged eager attention
    drops the softcap."""
    reference_model, model = model_pair(kind, reference)
    ours = continuous_batching(model.eval())
    assert model.config._attn_implementation == "mha_ext"
    assert_same_generations(ours, generate_one_by_one(reference_model.eval()), "vs generate")
    if kind != "gemma2":
        theirs = continuous_batching(reference_model)
        assert_same_generations(ours, theirs, f"vs continuous batching on {reference}")
    details = [d for name, d in calls if name == "attention_varlen"]
    assert len(details) == len(calls) > 0
    assert all(d["causal"] == "bottom_right" for d in details)
    assert_model_features(kind, details)


def test_continuous_batching_check_still_handles_other_implementations():
    """The wrapped check leaves "mha_ext" alone and defers every other name to transformers
    (here: eager moves to paged|eager)."""
    eager_model, model = model_pair("llama")
    manager = types.SimpleNamespace(_original_attn_impl=None)
    ContinuousBatchingManager.switch_to_cb_friendly_attn(manager, model, False)
    assert model.config._attn_implementation == "mha_ext"
    ContinuousBatchingManager.switch_to_cb_friendly_attn(manager, eager_model, False)
    assert eager_model.config._attn_implementation == "paged|eager"
    assert manager._original_attn_impl == "eager"


def test_set_attn_implementation_switches_a_loaded_model(calls):
    eager_model, _ = model_pair("gemma2")
    input_ids, attention_mask, _ = padded_batch("right")
    eager_model.eval()
    with torch.no_grad():
        expected = eager_model(input_ids=input_ids, attention_mask=attention_mask).logits
        eager_model.set_attn_implementation("mha_ext")
        actual = eager_model(input_ids=input_ids, attention_mask=attention_mask).logits
    assert len(calls) == 2
    kept = attention_mask.bool()
    assert_close(actual[kept], expected[kept], "logits after set_attn_implementation")


def test_register_is_idempotent():
    check = ContinuousBatchingManager.switch_to_cb_friendly_attn
    hf.register()
    assert ContinuousBatchingManager.switch_to_cb_friendly_attn is check
    assert transformers.AttentionInterface()["mha_ext"] is hf.mha_ext_attention_forward
    assert AttentionMaskInterface()["mha_ext"] is hf.mha_ext_mask


# Mask function: which patterns stay on mha_ext's fused paths, and that the others equal sdpa's.


def masks(mask_function, padding=None, local_size=None, q_length=6, q_offset=None, **kwargs):
    """(mha_ext's mask, sdpa's dense mask) for batch 2 and 6 keys; the queries are the last
    keys unless q_offset says otherwise (a static cache's queries are not)."""
    arguments = dict(
        batch_size=2,
        q_length=q_length,
        kv_length=6,
        q_offset=6 - q_length if q_offset is None else q_offset,
        mask_function=mask_function,
        attention_mask=padding,
        local_size=local_size,
        device=torch.get_default_device(),
    )
    return hf.mha_ext_mask(**arguments, **kwargs), sdpa_mask(
        **arguments, allow_is_causal_skip=False
    )


def test_mask_is_none_or_key_padding_for_causal_and_sliding_patterns():
    padding = torch.ones(2, 6, dtype=torch.bool)
    sliding = sliding_window_causal_mask_function(3)
    assert masks(causal_mask_function)[0] is None
    assert masks(causal_mask_function, padding)[0] is None  # every key attended
    assert masks(sliding, local_size=3, q_length=1)[0] is None  # a decode step
    padding[0, :2] = False
    for mask_function, local_size in ((causal_mask_function, None), (sliding, 3)):
        ours, _ = masks(mask_function, padding, local_size)
        assert ours.shape == (2, 6) and torch.equal(ours, padding)


@pytest.mark.parametrize(
    "case",
    [
        dict(local_size=3, chunked=True),  # chunked attention, which no window gives
        dict(allow_is_causal_skip=False),  # transformers combined overlays into the function
        dict(q_length=2, q_offset=0),  # a static cache: the queries are not the last keys
    ],
    ids=["chunked", "overlay", "static_cache"],
)
def test_mask_is_sdpa_dense_mask_for_other_patterns(case):
    padding = torch.ones(2, 6, dtype=torch.bool)
    padding[1, :1] = False
    mask_function = causal_mask_function
    if case.pop("chunked", False):
        mask_function = chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))
    ours, sdpa = masks(mask_function, padding, **case)
    assert ours.shape == (2, 1, case.get("q_length", 6), 6)
    assert torch.equal(ours, sdpa)


def test_a_4d_mask_alone_decides_which_keys_a_query_sees():
    """As in "sdpa" and "eager": no causal or window on top of a 4-D mask, but softcap,
    sinks and scaling still apply."""
    module = types.SimpleNamespace(is_causal=True)
    generator = seeded_generator(4)
    q = torch.randn(2, 4, 5, 8, generator=generator)
    k, v = (torch.randn(2, 2, 7, 8, generator=generator) for _ in range(2))
    sinks = torch.randn(4, generator=generator)
    mask = torch.rand(2, 1, 5, 7, generator=generator) > 0.3
    options = dict(scaling=0.5, softcap=1.5, s_aux=sinks)
    out, _ = hf.mha_ext_attention_forward(module, q, k, v, mask, sliding_window=2, **options)
    expected = mha_ext.attention(q, k, v, attn_mask=mask, scale=0.5, softcap=1.5, sinks=sinks)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=0)
    additive = torch.zeros(2, 1, 5, 7).masked_fill(~mask, float("-inf"))
    out_additive, _ = hf.mha_ext_attention_forward(module, q, k, v, additive, **options)
    torch.testing.assert_close(out_additive, out, rtol=1e-6, atol=1e-6)


# Errors


def call(attention_mask=None, **kwargs):
    module = types.SimpleNamespace(is_causal=True)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    return hf.mha_ext_attention_forward(module, q, k, v, attention_mask, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(output_attentions=True), "output_attentions=True needs the attention weights"),
        (dict(position_bias=torch.zeros(1, 4, 5, 5)), "position_bias"),
        (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), "block-table decode path"),
        (dict(sliding_window=0), "sliding_window must be an int >= 1, got 0"),
        (dict(attention_mask=torch.ones(1, 4, dtype=torch.bool)), r"expected \(1, 5\)"),
        (dict(attention_mask=torch.ones(1, 5, 5)), r"None, \(batch, kv_len\) or 4-D"),
        (dict(cu_seq_lens_q=torch.tensor([0, 5])), "got only cu_seq_lens_q"),
    ],
)
def test_unsupported_requests_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        call(**kwargs)
