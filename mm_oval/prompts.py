"""What a LLaVA request is made of, defined once for the harness, the chat, the trainers and the zoo:
LLaVA-1.5's evaluation prompts (the short-answer instruction, the MMBench prompt and its NA rule), the chat
template around them, images loaded from a path, and the processor's tensors moved to the model. Each
task declares which prompt it uses (`Task.prompt` in its own file under eval/); the prompts are defined here
because the bundled models' training data (mm_oval.zoo) use the same ones. A plain language model's text
prompts (a text task's context and question in one user turn, split where the question starts) are defined
here too, for the harness's text tasks, their traces and `Chat`.

The MMBench prompt is LLaVA-1.5's (`model_vqa_mmbench.py --single-pred-prompt`): the hint + "\\n" + the
question when the hint is present, one "\\nA. option" line per option, then "\\nAnswer with the option's
letter from the given choices directly.". A hint is absent when LLaVA's `is_none` says so: a missing cell
(None, NaN: what pandas makes of an empty, "NA", "N/A", "null", ... cell) or text that lowercases to "nan" or
"none"; an empty string (the zoo's "no hint", an empty cell read without pandas) counts as missing too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from .errors import ConfigError, DataError
from .files import is_missing

# LLaVA-1.5's instruction after short-answer questions (VQAv2, TextVQA, POPE, GQA, ...)
SHORT_ANSWER_PROMPT = "Answer the question using a single word or phrase."
MMBENCH_INSTRUCTION = "Answer with the option's letter from the given choices directly."
# the object-list task's instruction (eval/objlist.py): the answer is a comma-separated list
LIST_INSTRUCTION = "List each object by its color and shape, separated by commas."
OPTION_LETTERS = ("A", "B", "C", "D")
# where the cache is compressed: "prompt" = after the whole prompt (image + question) is prefilled, as
# LLaVA evaluates; "image" = right after the image, before the question is read (question-agnostic: the
# setting of an image cached once and asked about later; the first answer token is then computed on the
# compressed cache too). "context" is the same for a text task: the cache compressed right after the
# context, before the question is read (kvpress's protocol). The harness's --compress and the traces' prompt end.
COMPRESS_AT = ("prompt", "image", "context")


def is_none(cell: Any) -> bool:
    """LLaVA's `is_none`: a missing cell, an empty string, or text that lowercases to 'nan' or 'none'."""
    return is_missing(cell) or (isinstance(cell, str) and cell.lower() in ("", "nan", "none"))


def short_answer_prompt(question: str) -> str:
    """LLaVA-1.5's prompt for a short-answer question (VQAv2, TextVQA, POPE): the question, then the
    instruction on its own line."""
    return f"{question}\n{SHORT_ANSWER_PROMPT}"


def list_prompt(question: str) -> str:
    """The object-list task's prompt: the question, then the list instruction on its own line."""
    return f"{question}\n{LIST_INSTRUCTION}"


def mmbench_prompt(question: Any, hint: Any, options: list[Any]) -> str:
    """LLaVA-1.5's MMBench prompt (without the image token, which the chat template adds); `options` are
    the option texts in letter order, up to the first missing one."""
    text = str(question)
    if not is_none(hint):
        text = f"{hint}\n{text}"
    for letter, option in zip(OPTION_LETTERS, options):
        text += f"\n{letter}. {option}"
    return f"{text}\n{MMBENCH_INSTRUCTION}"


def chat_prompt(
    processor: Any, text: str, history: list[tuple[str, str]] | None = None, images: int = 1
) -> str:
    """The model's chat template around the conversation `history` ((question, answer) pairs) and `text`,
    with `images` image entries in the first user turn (LLaVA-1.5, one image, no history:
    "USER: <image>\\n{text} ASSISTANT:", also without a chat template)."""
    messages: list[dict] = []
    for i, (q, a) in enumerate([*(history or []), (text, None)]):
        content: list[dict] = [{"type": "text", "text": q}]
        if i == 0:
            content = [{"type": "image"}] * images + content
        messages.append({"role": "user", "content": content})
        if a is not None:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
    if getattr(processor, "chat_template", None):
        return processor.apply_chat_template(messages, add_generation_prompt=True)
    if history:
        raise ConfigError("a conversation of several turns needs a processor with a chat template")
    if images != 1:
        raise ConfigError("chatting with several images (or none) needs a processor with a chat template")
    return f"USER: <image>\n{text} ASSISTANT:"


def load_image(image: Any) -> Image.Image:
    """An RGB PIL image from a file path or a PIL image; a missing or unreadable file is a DataError."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, Path)):
        path = Path(image)
        if not path.is_file():
            raise DataError(f"image file {path} does not exist; pass the path of a PNG or JPEG image")
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise DataError(f"image file {path} cannot be read as an image ({e})") from e
    raise ConfigError(f"an image is a file path or a PIL image, got {type(image).__name__}")


def to_model(inputs: Any, model: Any) -> dict[str, torch.Tensor]:
    """The processor's tensors on the model's device, floating ones in the model's dtype."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(model.device)
            if v.is_floating_point():
                v = v.to(model.dtype)
            out[k] = v
    return out


# ---- a plain language model's text prompts (the text tasks, their traces and text chats) ----------------
SEPARATOR = "\n\n"  # between a text task's context and its question, in one user message
_QUESTION_MARK = "\u2063MMOVAL-QUESTION\u2063"


def tokenizer_of(processor: Any) -> Any:
    """The tokenizer of a processor, or the tokenizer itself (a plain LM comes with one)."""
    return getattr(processor, "tokenizer", processor)


def render_chat(tok: Any, messages: list[dict]) -> str:
    """The tokenizer's chat template around `messages` (plain-text contents), with the assistant tag."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError(
            "text tasks and text chats render the model's chat template, and this tokenizer has none"
        )
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def context_prompt(tok: Any, context: str, question: str) -> tuple[str, str]:
    """(head, tail) texts of the first user turn `context` + SEPARATOR + `question`: the template's head with
    the context and the separator (what is prefilled and compressed before the question is read), then the
    question with the template's tail (the assistant tag)."""
    rendered = render_chat(
        tok, [{"role": "user", "content": f"{context}{SEPARATOR}{_QUESTION_MARK}{question}"}]
    )
    head, tail = rendered.split(_QUESTION_MARK, 1)
    return head, tail
