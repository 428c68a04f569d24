"""`PagedMultimodalCache`: the cache of one request (batch), a transformers `Cache` of `PagedLayer`s, with
the request's policies, its prompt facts (`RequestInfo`), its typed request and step state
(`mm_oval.core`), its counters and the decode backend its layers share."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

from ..allocation import check_policy
from ..config import OvalConfig
from ..core import RequestState, Rope, StepState
from ..errors import ConfigError
from ..geometry import Geometry
from ..telemetry import RetrievalMonitor
from .decode import MaskedDecode, ReadRule, choose_backend
from .layer import PagedLayer
from .request import RequestInfo, request_info

if TYPE_CHECKING:
    from ..policies.base import EvictionPolicy, RetrievalPolicy


class PagedMultimodalCache(Cache):
    """The cache of one request (batch), serving the policies of its model's wrap. Built by the wrapped
    model's `generate`; build one yourself with `mm_oval.wrapper.new_cache` / `new_request` / `prefill`
    (e.g. for a multi-turn session)."""

    def __init__(
        self,
        text_config: Any,
        config: OvalConfig,
        eviction: EvictionPolicy | None = None,
        retrieval: RetrievalPolicy | None = None,
    ):
        n_layers = text_config.num_hidden_layers
        super().__init__(layers=[PagedLayer(self, i) for i in range(n_layers)])
        self.config = config
        if (eviction is None and config.method != "full") or (retrieval is None and config.retrieval):
            raise ConfigError(  # the policies are the wrap's, built once (mm_oval.wrapper.make_policies)
                "a cache serves its wrapped model's policies: build it with mm_oval.wrapper.new_cache(model)"
            )
        check_policy(eviction, config.head_budget)  # a budget shared by the heads needs comparable scores
        self.eviction = eviction
        self.retrieval = retrieval
        self.info: RequestInfo | None = None
        self.request = RequestState()  # what the request carries from layer to layer, step to step
        self.step = StepState()  # the forward now running (prefill or a decode step)
        self.geometry: Geometry | None = None  # the request's image geometry, when prepared with one
        self.rope: Rope | None = None  # the text model's RoPE, set by the wrapped model before prefill
        # tensors once counted; read_over_budget: (KV head, step, layer) triples whose summaries and
        # always-read pages alone exceed the bytes budget (they read no optional page)
        self.counters: dict[str, Any] = {
            "candidate_pages": 0, "pages_read": 0, "read_over_budget": 0, "dense_chunk_reads": 0
        }  # fmt: skip
        self._kernels: bool | None = None  # decode through mm_oval.kernels; None = on CUDA only
        self._backend: MaskedDecode | None = None  # the request's decode backend, chosen at its first step
        self._scratch: torch.Tensor | None = None  # GatheredDecode's buffer
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
        # retrieval against exact attention, per decode step and layer (stats' retrieval_monitor)
        self.monitor = RetrievalMonitor() if config.monitor_retrieval else None
        self._read_rule: ReadRule | None = None  # built at the first read (read_rule)

    @property
    def read_rule(self) -> ReadRule | None:
        """How the layers read after the prefill (`decode.ReadRule`, from the configuration); None without a
        retrieval policy (every page is read)."""
        if self.retrieval is None:
            return None
        if self._read_rule is None:
            self._read_rule = ReadRule.of(self.config, len(self.layers))
        return self._read_rule

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `numel` entries, shared by the layers' decode steps (one layer at a
        time uses it) and grown when a step needs more; what it holds does not outlive the step."""
        buf = self._scratch
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._scratch = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    @property
    def kernels(self) -> bool | None:
        """Decode through mm_oval.kernels (True), not (False), or on CUDA only (None, the default)."""
        return self._kernels

    @kernels.setter
    def kernels(self, value: bool | None) -> None:
        self._kernels, self._backend = value, None  # the next step chooses the backend again

    def use_kernels(self, query: torch.Tensor) -> bool:
        return query.is_cuda if self._kernels is None else self._kernels

    def decode_backend(self, query: torch.Tensor) -> MaskedDecode:
        """The request's decode backend (`decode.choose_backend`), chosen at its first decode step."""
        if self._backend is None:
            self._backend = choose_backend(self, query)
        return self._backend

    def prepare(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        image_token_id: int | None = None,
        tokens_per_image: int = 0,
        geometry: Geometry | None = None,
    ) -> None:
        """Ready the cache for one request: the image tokens and their (grid, row, col) from `geometry`
        (mm_oval.geometry.image_geometry), or from `image_token_id` and `tokens_per_image` (LLaVA-1.5)."""
        if self.get_seq_length() != 0:
            raise ConfigError(
                "this cache already holds a request; build a new one (or cache.copy()) per request"
            )
        self.info = request_info(
            input_ids,
            attention_mask,
            image_token_id,
            tokens_per_image,
            self.config.sink_tokens,
            self.config.recent_tokens,
            geometry,
        )
        self.geometry = geometry

    def copy(self) -> PagedMultimodalCache:
        """An independent copy (e.g. to ask several questions about one compressed image)."""
        # share what is not per-request state: the model's modules and the policies
        memo: dict[int, Any] = {id(self.eviction): self.eviction, id(self.retrieval): self.retrieval}
        if self._scratch is not None:  # a step's buffer: the copy makes its own when it needs one
            memo[id(self._scratch)] = None
        for layer in self.layers:
            m = getattr(layer, "module", None)
            if m is not None:
                memo[id(m)] = m
        return copy.deepcopy(self, memo)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ConfigError("beam search is not supported by mm-oval's cache; use greedy or sampling")
