import pytest
from transformers import LlavaForConditionalGeneration

import mm_oval
from mm_oval.config import OvalConfig, budget_field
from mm_oval.errors import ConfigError
from mm_oval.policies.base import make_eviction
from mm_oval.zoo import bundled_model_path


def test_a_retrieval_method_alone_reads_its_budget_of_pages_and_evicts_nothing():
    cfg = OvalConfig.from_spec("oval:eta=0.5", 0.25)
    assert (cfg.method, cfg.retrieval, cfg.read_budget, cfg.budget) == ("full", "oval", 0.25, 1.0)
    assert cfg.retrieval_options == {"eta": 0.5} and not cfg.evicts


def test_eviction_specs_keep_the_budget_on_the_image_kv_and_combine_with_retrieval():
    cfg = OvalConfig.from_spec("kvp:retrieval=oval,read_budget=0.5", 0.25)
    assert (cfg.method, cfg.budget, cfg.retrieval, cfg.read_budget) == ("kvp", 0.25, "oval", 0.5)
    assert OvalConfig.from_spec("snapkv", 1).evicts  # an int budget is a token count: one token
    with pytest.raises(ConfigError, match="read budget"):
        OvalConfig.from_spec("quest", 64)


def test_budget_allocators_take_their_own_options_and_hand_the_rest_to_their_scorer():
    cfg = OvalConfig.from_spec("pyramidkv:scorer=keydiff,beta=20", 0.25)
    assert (cfg.method, cfg.method_options) == ("pyramidkv", {"scorer": "keydiff", "beta": 20})
    pol = make_eviction(cfg.method, **cfg.method_options)
    assert (pol.scorer.name, pol.beta, pol.allocation.pyramid_beta, pol.allocation.share_heads) == (
        "keydiff",
        20,
        20.0,
        False,
    )
    cfg = OvalConfig.from_spec("adakv:scorer=snapkv,alpha_safeguard=0.3,window=16,text_budget=0.5", 0.25)
    assert cfg.text_budget == 0.5 and cfg.method_options == {
        "scorer": "snapkv",
        "alpha_safeguard": 0.3,
        "window": 16,
    }
    pol = make_eviction(cfg.method, **cfg.method_options)
    assert pol.scorer.window == 16 and pol.allocation.alpha_safeguard == 0.3 and pol.needs_queries
    assert (
        make_eviction("adakv").scorer.name == "snapkv" and make_eviction("pyramidkv").scorer.name == "snapkv"
    )
    both = make_eviction("adakv", scorer="pyramidkv", beta=4, kernel=3)  # nested: each takes its own options
    assert (both.scorer.beta, both.scorer.scorer.kernel) == (4, 3)
    assert (both.allocation.pyramid_beta, both.allocation.share_heads) == (4.0, True)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("adakv:scorer=knorm", r"adakv ranks the KV heads.*'knorm' are not comparable across heads"),
        ("knorm:head_budget=shared", r"head_budget=shared ranks.*'knorm' are not comparable"),
        ("pyramidkv:scorer=knorm,head_budget=shared", r"'knorm' are not comparable"),
        ("pyramidkv:scorer=adakv,alpha_safeguard=0.1,head_budget=shared", "adakv already shares"),
        ("adakv:head_budget=shared", "adakv already shares"),
    ],
)
def test_a_budget_shared_by_the_heads_is_refused_for_scores_not_comparable_across_heads(spec, match):
    with pytest.raises(ConfigError, match=match):
        OvalConfig.from_spec(spec, 0.25)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"scorer": "nope"}, r"adakv: scorer 'nope': unknown eviction method"),
        ({"scorer": "snapkv", "windw": 3}, r"adakv: scorer 'snapkv': bad options \{'windw': 3\}"),
        ({"scorer": "full"}, "scorer must be a registered eviction method other than 'full'"),
        ({"scorer": "adakv"}, "other than 'full' and 'adakv'"),
        ({"alpha_safeguard": 1.5}, r"alpha_safeguard must be in \[0, 1\]"),
        ({"alpha_safeguard": "high"}, r"alpha_safeguard must be in \[0, 1\]"),
    ],
)
def test_adakv_options_are_checked_with_a_message(options, match):
    with pytest.raises(ConfigError, match=match):
        make_eviction("adakv", **options)


def test_pyramidkv_options_are_checked_with_a_message():
    for beta in (0.5, "steep", True, float("inf")):
        with pytest.raises(ConfigError, match="beta must be a number >= 1"):
            make_eviction("pyramidkv", beta=beta)
    with pytest.raises(ConfigError, match="other than 'full' and 'pyramidkv'"):
        make_eviction("pyramidkv", scorer="pyramidkv")
    with pytest.raises(ConfigError, match="already a pyramidkv"):
        make_eviction("pyramidkv", scorer=make_eviction("adakv", scorer="pyramidkv"))
    with pytest.raises(ConfigError, match="go to a scorer named by string"):
        make_eviction("pyramidkv", scorer=make_eviction("snapkv"), window=8)


def test_kvp_agents_are_comparable_across_heads_only_when_trained_on_joint_heads():
    """What KVP's scores allow depends on its agents, known once they are loaded: the per-head agents are
    refused by adakv and by head_budget=shared when built (wrap), the joint-heads agents accepted."""

    assert not make_eviction("kvp").comparable_across_heads
    assert make_eviction("kvp", agents="bundled-joint").comparable_across_heads
    with pytest.raises(
        ConfigError, match=r"'kvp' are not comparable across heads \(KVP: agents trained with joint"
    ):
        make_eviction("adakv", scorer="kvp")
    assert make_eviction("adakv", scorer="kvp", agents="bundled-joint").comparable_across_heads
    model = LlavaForConditionalGeneration.from_pretrained(bundled_model_path()).eval()
    cfg = OvalConfig.from_spec("kvp:head_budget=shared", 0.25)  # the spec alone cannot tell
    with pytest.raises(ConfigError, match="head_budget=shared ranks the KV heads"):
        mm_oval.wrap(model, cfg)
    assert not mm_oval.is_wrapped(model)
    mm_oval.unwrap(
        mm_oval.wrap(model, OvalConfig.from_spec("kvp:head_budget=shared,agents=bundled-joint", 0.25))
    )


def test_a_key_given_twice_in_a_spec_is_refused_rather_than_one_silently_winning():
    with pytest.raises(ConfigError, match="'scorer' is given twice"):
        OvalConfig.from_spec("adakv:scorer=pyramidkv,scorer=kvzip", 0.25)
    with pytest.raises(ConfigError, match="'eviction_scope' is given twice"):
        OvalConfig.from_spec("snapkv:eviction_scope=all,eviction_scope=image", 0.25)


def test_the_budget_axis_of_a_spec_is_the_read_budget_for_a_retrieval_method_and_says_so():
    assert budget_field("oval") == budget_field("quest:foo=1") == "read_budget"
    assert budget_field("snapkv") == budget_field("kvp:retrieval=oval") == budget_field("full") == "budget"
    assert OvalConfig.from_spec("oval:read_budget=0.5").read_budget == 0.5  # the key alone is fine
    with pytest.raises(ConfigError, match=r"retrieval method.*no \(text_\)budget.*oval:read_budget="):
        OvalConfig.from_spec("oval:budget=0.25")
    with pytest.raises(ConfigError, match="no \\(text_\\)budget"):
        OvalConfig.from_spec("quest:text_budget=0.5", 0.25)
    with pytest.raises(ConfigError, match="read_budget and a budget of 0.25 is given too"):
        OvalConfig.from_spec("oval:read_budget=0.5", 0.25)
    with pytest.raises(ConfigError, match="read budget in \\(0, 1\\]"):
        OvalConfig.from_spec("oval", 16)  # a token count is an eviction budget, not a fraction of pages


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"budget": 0.25}, "budget=0.25 set with method 'full'"),
        ({"text_budget": 8}, "text_budget=8 set with method 'full'"),
        ({"eviction_scope": "all"}, "eviction_scope='all' set with method 'full'"),
        ({"head_budget": "shared"}, "head_budget='shared' set with method 'full'"),
        ({"read_budget": 0.5}, "read_budget=0.5 set without a retrieval method"),
        ({"read_scope": "all"}, "read_scope='all' set without a retrieval method"),
        ({"retrieval_options": {"eta": 1.0}}, "retrieval_options=.* set without a retrieval method"),
        ({"method": "oval"}, "is a retrieval method .* set retrieval='oval'"),
        ({"method": "snapky"}, "unknown eviction method 'snapky'"),
        ({"method": "snapkv", "retrieval": "ovl"}, "unknown retrieval method 'ovl'"),
    ],
)
def test_a_knob_the_configuration_cannot_use_is_refused_not_ignored(kw, match):
    with pytest.raises(ConfigError, match=match):
        OvalConfig(**kw)


def test_the_two_scopes_have_their_own_names_and_the_former_ones_are_refused_with_the_new():
    cfg = OvalConfig(method="snapkv", budget=0.25, eviction_scope="all", retrieval="quest", read_scope="all")
    assert (cfg.eviction_scope, cfg.read_scope) == ("all", "all")
    assert "scope" not in cfg.to_dict() and "retrieval_scope" not in cfg.to_dict()
    with pytest.raises(ConfigError, match="no 'scope' any more: write eviction_scope='all'"):
        OvalConfig(method="snapkv", scope="all")
    with pytest.raises(ConfigError, match="no 'retrieval_scope' any more: write read_scope='all'"):
        OvalConfig(retrieval="quest", retrieval_scope="all")
    with pytest.raises(ConfigError, match="write eviction_scope="):
        cfg.replace(scope="image")
    with pytest.raises(
        ConfigError, match="'scope' in method spec 'kvp:scope=all' is now called 'eviction_scope'"
    ):
        OvalConfig.from_spec("kvp:scope=all", 0.25)
    with pytest.raises(ConfigError, match="'retrieval_scope' .* is now called 'read_scope'"):
        OvalConfig.from_spec("oval:retrieval_scope=all", 0.25)
    assert OvalConfig.from_spec("oval:read_scope=all", 0.25).read_scope == "all"


def test_retrieval_options_ride_in_an_eviction_spec_with_their_prefix():
    cfg = OvalConfig.from_spec(
        "kvp:agents=bundled576-image,retrieval=oval,retrieval.summary_format=compact,retrieval.rank=4,"
        "read_bytes_budget=0.5",
        0.25,
    )
    assert cfg.method == "kvp" and cfg.budget == 0.25 and cfg.read_bytes_budget == 0.5
    assert cfg.retrieval == "oval" and cfg.retrieval_options == {"summary_format": "compact", "rank": 4}
    assert cfg.method_options == {"agents": "bundled576-image"}
    with pytest.raises(ConfigError, match="given twice"):
        OvalConfig.from_spec("snapkv:retrieval=oval,retrieval.rank=4,retrieval.rank=2", 0.25)
    with pytest.raises(ConfigError, match=r"retrieval\.<option>"):
        OvalConfig.from_spec("snapkv:retrieval=oval,retrieval.=4", 0.25)
