"""`PagedMultimodalCache`: a transformers `Cache` whose layers keep, per KV head, the tokens an eviction
policy chose at the end of prefill, laid out in pages, and attend at decode over all of them or over the
pages a retrieval policy picks.

How it plugs into an unmodified model (the attention hand-off, the one place it is described):
1. the attention module calls `cache.update(keys, values, layer_idx)` just before its attention function;
   the layer (`PagedLayer.update`, `layer.py`) stores the new keys/values and leaves itself in `_PENDING`,
   a context variable, for that attention function;
2. the attention function mm-oval registered (`mm_oval.wrapper`, `mm_oval_<inner>`) picks the layer up
   with `take_pending(module.layer_idx)` (None: this forward is not through a `PagedMultimodalCache`, e.g.
   a policy's own pass with a `DynamicCache`, and the model's own attention runs unchanged);
3. prefill (`layer.phase == "prefill"`): the model's own attention runs over the whole prompt, then
   `layer.finish_prefill(query, module, scaling)` (`prefill.py`, its steps in order) scores the tokens with
   the eviction policy, keeps the budget's top, lays the kept tokens out in pages, compacts them into the
   layer's storage (`storage.py`) and summarises them for the retrieval policy (`summaries.py`);
4. decode: `layer.attend(query, scaling)` is exact attention over the kept slots (with retrieval, over the
   pages `read_pages` selects plus the always-read ones) by the request's decode backend (`decode.py`:
   kernel, gathered or masked SDPA), the model's attention function is not called.
`get_seq_length()` is the logical length (prompt + generated), which `generate` uses to slice the inputs;
RoPE positions come from the attention mask and stay the original ones.

What the policies read besides keys and values comes from the cache's typed state (`mm_oval.core`):
`cache.request` (a `RequestState`, per request) and `cache.step` (a `StepState`, per forward), set by the
wrapped model's hooks (`mm_oval.wrapper`) and by the policies themselves. What the cache measures (tokens
kept, bytes read, the retrieval monitor's records) is kept beside the storage (`telemetry.py`).

The package, by job: `multimodal.py` the cache of a request, `layer.py` one layer (the hand-off above),
`request.py` the prompt's token facts and the budget's choice, `prefill.py` the end of a layer's prefill,
`storage.py` slots and page table, `summaries.py` the retrieval policy's page summaries, `decode.py` a
decode step's reads and its backends, `telemetry.py` the counts. Their tunables (`decode.GATHER_SHARE`,
`summaries.SUMMARY_TEMP_SHARE`, `storage.DECODE_ROOM`) live, and are patched, in their own modules.
"""

from .decode import GatheredDecode, KernelDecode, MaskedDecode
from .layer import PagedLayer, take_pending
from .multimodal import PagedMultimodalCache
from .request import RequestInfo, choose_kept, request_info
from .storage import PageStore
from .telemetry import READ_KINDS, ReadTelemetry, kv_bytes_per_token, page_kv_bytes, pages_within_bytes

__all__ = [
    "READ_KINDS",
    "GatheredDecode",
    "KernelDecode",
    "MaskedDecode",
    "PageStore",
    "PagedLayer",
    "PagedMultimodalCache",
    "ReadTelemetry",
    "RequestInfo",
    "choose_kept",
    "kv_bytes_per_token",
    "page_kv_bytes",
    "pages_within_bytes",
    "request_info",
    "take_pending",
]
