"""KVP agent scoring: the one-launch Triton kernel (interpreter on CPU) against the reference, and the
reference against the agents module that owns the weights (the layout agreed in docs/kernels.md)."""

from __future__ import annotations

import pytest
import torch
from mm_oval.kernels import KVPWeights, kvp_score
from mm_oval.kernels.kvp_score import kvp_score_triton
from mm_oval.kernels.reference import kvp_score_ref

from mm_oval.errors import ConfigError


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B, H, N, D, E, Ep, L, F",
    [
        (2, 2, 37, 64, 32, 16, 50, 32),  # N not a multiple of the token tile
        (1, 3, 20, 16, 48, 8, 10, 40),  # widths that are not powers of two, positions past the table
        (3, 1, 33, 128, 64, 32, 64, 64),
    ],
)
def test_kernel_matches_reference(B, H, N, D, E, Ep, L, F, dtype):
    g = torch.Generator().manual_seed(N + H)
    w = KVPWeights.random(H, D, E, Ep, L, F, generator=g)
    k = torch.randn(B, H, N, D, generator=g).to(dtype)
    v = torch.randn(B, H, N, D, generator=g).to(dtype)
    pos = torch.randint(-1, L + 5, (B, N), generator=g)
    got = kvp_score_triton(k, v, pos, w)
    want = kvp_score_ref(k, v, pos, w)
    assert got.shape == (B, H, N) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5


def test_reference_is_the_agents_module():
    """KVPAgents (mm_oval/policies/kvp.py) hands its layer weights over in the kernels' layout; the
    reference must score exactly as the module does."""
    from mm_oval.policies import kvp

    cfg = kvp.KVPAgentConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        proj=32,
        pos_dim=8,
        pos_table=40,
        hidden=24,
        extra_features=(),
    )
    torch.manual_seed(0)
    agents = kvp.KVPAgents(cfg)
    with torch.no_grad():  # non-trivial LayerNorm and bias parameters
        for p in agents.parameters():
            p.add_(0.1 * torch.randn_like(p))
    B, N = 2, 19
    keys, values = torch.randn(B, 2, N, 16), torch.randn(B, 2, N, 16)
    positions = torch.arange(N).repeat(B, 1) * 3
    modality = torch.zeros(B, N, dtype=torch.int8)
    image_rc = torch.full((B, N, 3), -1)
    with torch.no_grad():
        want = agents.score_layer(1, keys, values, positions, modality, image_rc)
    got = kvp_score_ref(keys, values, positions, agents.layer_weights(1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        kvp_score_triton(keys, values, positions, agents.layer_weights(1)), want, rtol=1e-4, atol=1e-4
    )


def test_agents_for_another_shape_are_refused():
    w = KVPWeights.random(2, 16, 16, 8, 10, 16)
    with pytest.raises(ConfigError, match="agents are for 2 heads of dim 16"):
        kvp_score(torch.zeros(1, 3, 4, 16), torch.zeros(1, 3, 4, 16), torch.zeros(1, 4), w)
