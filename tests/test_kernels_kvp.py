"""KVP agent scoring: the one-launch Triton kernel (interpreter on CPU) against naive.py, with and
without the extra per-token features, and naive.py against the agents module that owns the weights,
on random agents and on the agents bundled with the tiny LLaVA."""

from __future__ import annotations

import pytest
import torch
from mm_oval.kernels import KVPWeights, kvp_score
from mm_oval.kernels.kvp.kernel import kvp_score_triton
from mm_oval.kernels.kvp.naive import kvp_score_naive, position_table

from mm_oval.errors import ConfigError
from mm_oval.policies.base import IMAGE, PAD, TEXT
from mm_oval.policies.kvp_agents import KVPAgentConfig, KVPAgents
from mm_oval.policies.kvp_features import extra_features
from mm_oval.policies.kvp_io import BUNDLED_AGENTS, bundled_agents_path, load_agents


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B, H, N, D, E, Ep, L, F, X",
    [
        (2, 2, 37, 64, 32, 16, 50, 32, 0),  # N not a multiple of the token tile
        (1, 3, 20, 16, 48, 8, 10, 40, 0),  # widths that are not powers of two, positions past the table
        (3, 1, 33, 128, 64, 32, 64, 64, 0),
        (2, 2, 37, 32, 64, 16, 50, 64, 24),  # the bundled agents' extra features (modality, grid, relpos)
        (1, 3, 20, 16, 48, 8, 10, 40, 5),  # an extra width that is not a power of two
    ],
)
def test_kernel_matches_naive(B, H, N, D, E, Ep, L, F, X, dtype, table):
    g = torch.Generator().manual_seed(N + H + X)
    w = KVPWeights.random(H, D, E, Ep, L, F, generator=g, extra=X)
    k = torch.randn(B, H, N, D, generator=g).to(dtype)
    v = torch.randn(B, H, N, D, generator=g).to(dtype)
    pos = torch.randint(-1, L + 5, (B, N), generator=g)
    extra = torch.randn(B, N, X, generator=g) if X else None
    if table:  # the position branch precomputed per table row scores the same
        before = kvp_score_naive(k, v, pos, w, extra)
        w.pos_term = position_table(w)
        torch.testing.assert_close(kvp_score_naive(k, v, pos, w, extra), before)
    got = kvp_score_triton(k, v, pos, w, extra)
    want = kvp_score_naive(k, v, pos, w, extra)
    assert got.shape == (B, H, N) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5


def _prompt(B: int, N: int, grid: int = 4, seed: int = 0):
    """Text, then a grid x grid image, then text; the last tokens of sample 1 are padding."""
    g = torch.Generator().manual_seed(seed)
    modality = torch.full((B, N), TEXT)
    rc = torch.full((B, N, 3), -1)
    n_img = grid * grid
    modality[:, 3 : 3 + n_img] = IMAGE
    cells = torch.arange(n_img)
    rc[:, 3 : 3 + n_img] = torch.stack([torch.zeros_like(cells), cells // grid, cells % grid], -1)
    modality[1:, -5:] = PAD
    positions = torch.arange(N).repeat(B, 1)
    return positions, modality, rc, g


@pytest.mark.parametrize(
    "features, shared", [((), False), (("modality", "grid", "relpos"), False), (("relpos",), True)]
)
def test_naive_is_the_agents_module(features, shared):
    """KVPAgents hands its layer weights over in the kernels' layout; the reference (and the kernel) must
    score as the module's differentiable path does, extra features included."""
    cfg = KVPAgentConfig(
        num_layers=2, num_kv_heads=2, head_dim=16, proj=32, pos_dim=8, pos_table=40, hidden=24,
        extra_features=features, shared=shared,
    )  # fmt: skip
    torch.manual_seed(0)
    agents = KVPAgents(cfg)
    with torch.no_grad():  # non-trivial LayerNorm and bias parameters
        for p in agents.parameters():
            p.add_(0.1 * torch.randn_like(p))
    B, N = 2, 27
    positions, modality, rc, g = _prompt(B, N)
    keys, values = torch.randn(B, 2, N, 16, generator=g), torch.randn(B, 2, N, 16, generator=g)
    want = agents.score_layer(1, keys, values, positions, modality, rc)  # autograd path
    assert want.requires_grad
    extra = extra_features(positions, modality, rc, features) if features else None
    w = agents.layer_weights(1)
    assert w.extra_width == cfg.extra_width
    live = modality[:, None, :].expand(B, 2, N) != PAD
    for fn in (kvp_score_naive, kvp_score_triton):
        torch.testing.assert_close(fn(keys, values, positions, w, extra)[live], want.detach()[live])
    with torch.no_grad():  # without gradients the module scores through the dispatcher
        torch.testing.assert_close(
            agents.score_layer(1, keys, values, positions, modality, rc), want.detach()
        )


@pytest.mark.parametrize("name", sorted(BUNDLED_AGENTS))
def test_bundled_agents_score_through_the_kernel_as_through_the_module(name, monkeypatch):
    """The shipped agents read modality / grid / relpos features: scoring them without gradients goes
    through the kvp_score dispatcher, whose reference gives the module's numbers and whose Triton kernel
    agrees with it."""
    agents = load_agents(bundled_agents_path(name=name)).agents
    c = agents.config
    assert c.extra_features and agents.use_extra
    B, N = 2, 90
    positions, modality, rc, g = _prompt(B, N, grid=8, seed=1)
    keys = torch.randn(B, c.num_kv_heads, N, c.head_dim, generator=g)
    values = torch.randn(B, c.num_kv_heads, N, c.head_dim, generator=g)
    layer = c.num_layers - 1
    agents.requires_grad_(True)
    module = agents.score_layer(layer, keys, values, positions, modality, rc).detach()
    agents.requires_grad_(False)
    live = torch.isfinite(module)
    for forced in ("torch", "triton"):
        monkeypatch.setenv("MM_OVAL_KERNELS", forced)
        with torch.no_grad():
            got = agents.score_layer(layer, keys, values, positions, modality, rc)
        assert torch.equal(torch.isfinite(got), live)
        if forced == "torch":
            torch.testing.assert_close(got[live], module[live], rtol=1e-5, atol=1e-5)
        else:
            assert rel_err(got[live], module[live]) < 1e-5


def test_agents_for_another_shape_or_without_their_features_are_refused():
    w = KVPWeights.random(2, 16, 16, 8, 10, 16)
    with pytest.raises(ConfigError, match="agents are for 2 heads of dim 16"):
        kvp_score(torch.zeros(1, 3, 4, 16), torch.zeros(1, 3, 4, 16), torch.zeros(1, 4), w)
    with pytest.raises(ConfigError, match="read no extra features"):
        kvp_score(
            torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16), torch.zeros(1, 4), w, torch.zeros(1, 4, 3)
        )
    wx = KVPWeights.random(2, 16, 16, 8, 10, 16, extra=6)
    with pytest.raises(ConfigError, match="read 6 extra features per token"):
        kvp_score(torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16), torch.zeros(1, 4), wx)
