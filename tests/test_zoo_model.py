from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mm_oval.zoo.model import build_tiny_llava


def test_tiny_llava_round_trips_through_from_pretrained(tmp_path):
    model, processor = build_tiny_llava(seed=1)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = LlavaForConditionalGeneration.from_pretrained(tmp_path)
    proc = AutoProcessor.from_pretrained(tmp_path)
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "what color is the circle ?"}],
        }
    ]
    prompt = proc.apply_chat_template(msgs, add_generation_prompt=True)
    assert prompt == "USER: <image>\nwhat color is the circle ? ASSISTANT:"
    inputs = proc(images=[Image.new("RGB", (128, 128), "gray")], text=[prompt], return_tensors="pt")
    assert int((inputs["input_ids"] == loaded.config.image_token_id).sum()) == 64
    assert "<unk>" not in proc.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    a = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    b = loaded.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert a.tolist() == b.tolist()
