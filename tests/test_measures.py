"""The yardstick (mm_oval.measures): the page attention mass agrees with the log mass computed from the keys
in pages, tokens in no page count for none, the GQA combination is the group mean; the Q/K capture sees
every layer's queries and keys without changing the model's output and restores the model on exit."""

import pytest
import torch

from mm_oval.measures import (
    CAPTURE_ATTN,
    capture_qk,
    exact_attention,
    exact_page_log_mass,
    group_mean,
    page_mass,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_page_mass_is_the_normalised_exact_page_log_mass_and_its_group_mean():
    g = torch.Generator().manual_seed(0)
    B, H, G, P, T, D = 3, 2, 2, 5, 4, 8
    keys = torch.randn(B, H, P * T, D, generator=g)
    query = torch.randn(B, H * G, D, generator=g)
    slot_page = (torch.arange(P * T) // T).expand(B, H, P * T)
    attn = exact_attention(query, keys, torch.ones(B, H, P * T, dtype=torch.bool), 0.3)
    mass = page_mass(attn, slot_page, P)  # (B, Hq, P)
    log_mass = exact_page_log_mass(
        query, keys.view(B, H, P, T, D), torch.ones(B, H, P, T, dtype=torch.bool), 0.3
    )
    torch.testing.assert_close(mass, torch.softmax(log_mass, -1))
    combined = page_mass(attn, slot_page, P, kv_heads=H)
    torch.testing.assert_close(combined, torch.softmax(log_mass, -1).view(B, H, G, P).mean(2))
    torch.testing.assert_close(combined, group_mean(mass, H))


def test_tokens_in_no_page_count_for_none_and_one_layout_serves_every_head():
    attn = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])  # (Hq=2, N=4)
    token_page = torch.tensor([1, -1, 0, 1])
    mass = page_mass(attn, token_page, 3)
    torch.testing.assert_close(mass, torch.tensor([[0.3, 0.5, 0.0], [0.2, 0.5, 0.0]]))
    per_kv_head = page_mass(attn, token_page.view(1, 4), 3)  # one KV head's layout for both query heads
    torch.testing.assert_close(per_kv_head, mass)
    torch.testing.assert_close(page_mass(attn, token_page, 3, kv_heads=1), mass.mean(0, keepdim=True))


def _prompt(processor):
    from PIL import Image

    image = Image.fromarray(
        (torch.rand(128, 128, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy()
    )
    return dict(
        processor(images=[image], text=["USER: <image>\nwhat color ? ASSISTANT:"], return_tensors="pt")
    )


@torch.no_grad()
def test_capture_sees_every_layer_keeps_the_output_and_restores_the_model(tiny_random_llava):
    model, processor = tiny_random_llava
    inputs = _prompt(processor)
    lm = model.model.language_model
    text = model.config.text_config
    before = lm.config._attn_implementation
    plain = model(**inputs).logits
    with capture_qk(model) as cap:
        assert lm.config._attn_implementation == CAPTURE_ATTN
        assert model.model.vision_tower.config._attn_implementation == before  # the vision tower is untouched
        captured = model(**inputs).logits
    assert lm.config._attn_implementation == before
    torch.testing.assert_close(captured, plain)
    n = inputs["input_ids"].shape[1]
    assert sorted(cap.layers) == list(range(text.num_hidden_layers))
    qk = cap.layers[0]
    assert qk.query.shape == (1, text.num_attention_heads, n, text.head_dim)
    assert qk.key.shape == qk.value.shape == (1, text.num_key_value_heads, n, text.head_dim)
    assert qk.scaling == pytest.approx(text.head_dim**-0.5)
    assert qk.module is lm.layers[0].self_attn
    with pytest.raises(RuntimeError, match="stop"), capture_qk(lm):  # restored when the block raises
        raise RuntimeError("stop")
    assert lm.config._attn_implementation == before


@torch.no_grad()
def test_capture_hands_calls_to_on_layer_and_nested_captures_restore_the_outer(tiny_random_llava):
    model, processor = tiny_random_llava
    inputs = _prompt(processor)
    seen: list[int] = []
    with capture_qk(model) as outer:
        with capture_qk(model, on_layer=lambda qk: seen.append(int(qk.module.layer_idx))) as inner:
            model(**inputs)
        assert not inner.layers and not outer.layers  # on_layer keeps nothing; the outer saw none of it
        model(**inputs)
    layers = model.config.text_config.num_hidden_layers
    assert seen == list(range(layers))
    assert sorted(outer.layers) == list(range(layers))
    assert model.model.language_model.config._attn_implementation == "sdpa"


@torch.no_grad()
def test_capture_works_on_a_plain_decoder_only_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (1, 9))
    plain = model(input_ids=ids).logits
    with capture_qk(model) as cap:
        captured = model(input_ids=ids).logits
    torch.testing.assert_close(captured, plain)
    assert sorted(cap.layers) == [0, 1] and cap.layers[1].key.shape == (1, 2, 9, 8)
    assert model.config._attn_implementation == "sdpa"
