"""The bundled tiny LLaVA: vocabulary, tokenizer/processor, model builder, data generator, trainer.

`bundled_model_path()` is the committed checkpoint (loads with `LlavaForConditionalGeneration.from_pretrained`
and `AutoProcessor.from_pretrained`); `bundled_data_dir()` is the committed synthetic dev sets
(MMBench TSV, VQAv2 JSON, POPE JSONL, images, targets.json); `bundled576_data_dir()` the 576-token
benchmark's (the same files plus the list task's list_dev.jsonl)."""

from __future__ import annotations

# where the bundled checkpoints and dev sets are found lives below the zoo (mm_oval.bundled): the model
# loader and the evaluation tasks resolve `bundled` names without importing the zoo's builders
from ..bundled import bundled576_data_dir, bundled576_model_path, bundled_data_dir, bundled_model_path

__all__ = ["bundled576_data_dir", "bundled576_model_path", "bundled_data_dir", "bundled_model_path"]
