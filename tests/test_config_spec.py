import pytest

from mm_oval.config import OvalConfig
from mm_oval.errors import ConfigError


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
