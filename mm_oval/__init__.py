"""mm-oval: a KV-cache manager for LLaVA-style vision-language models.

import mm_oval
model = mm_oval.wrap(model, method="kvp", budget=0.25)
model.generate(**inputs)

with mm_oval.wrapped(model, method="snapkv", budget=0.25):   # wrapped inside the block, restored after
    model.generate(**inputs)
"""

from .errors import ConfigError, DataError, MmOvalError, ModelError, ResultsError

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataError",
    "MmOvalError",
    "ModelError",
    "OvalConfig",
    "ResultsError",
    "__version__",
    "is_wrapped",
    "unwrap",
    "wrap",
    "wrapped",
]


def __getattr__(name: str):
    # wrap/unwrap/wrapped/is_wrapped/OvalConfig are imported lazily so `import mm_oval` stays light
    # (the module is wrapper.py, not wrap.py: a submodule named `wrap` would shadow the function)
    if name in ("wrap", "unwrap", "wrapped", "is_wrapped"):
        from . import wrapper

        return getattr(wrapper, name)
    if name == "OvalConfig":
        from .config import OvalConfig

        return OvalConfig
    raise AttributeError(f"module 'mm_oval' has no attribute {name!r}")
