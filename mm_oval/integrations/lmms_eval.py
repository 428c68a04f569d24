"""The lmms-eval entry point (`pip install "mm-oval[lmms]"`): registers the model `mm_oval_llava`.

pyproject.toml declares `[project.entry-points."lmms_eval.models"] mm_oval_llava = ...:manifest`;
lmms-eval 0.7 loads every manifest of that group when `lmms_eval.models` is imported. This module does
not import lmms-eval's model classes itself, so listing the entry point stays cheap; the model class
lives in `mm_oval.integrations.lmms_model`.
"""

from __future__ import annotations

MODEL_ID = "mm_oval_llava"
CLASS_PATH = "mm_oval.integrations.lmms_model.MmOvalLlava"


def manifest():
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, simple_class_path=CLASS_PATH)
