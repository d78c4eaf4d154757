"""Routing settings through config.parse: env precedence, per-model overrides, validation at load."""


import pytest

from extproc.config import ConfigError, parse
from extproc.fleetsim.gateways import config_with_seed
from extproc.routing.settings import AutoBlendSettings, LoadBalanceSettings, env_variables

BASE = {"models": {"m": {"pods": [{"name": "p0", "address": "10.0.0.1:8000"}]}}}


def with_model_routing(routing_config):
    return {"models": {"m": {**BASE["models"]["m"], "routingConfig": routing_config}}}


def test_defaults():
    c = parse(BASE, {})
    s = c.routing_settings
    assert c.default_strategy == s.default_strategy == "load-balance"
    assert s.load_balance == LoadBalanceSettings(0.0, 2.0, 0.10, 2.0, 8.0)
    assert s.auto_blend == AutoBlendSettings(1, 1, 5, 4)


def test_aibrix_variables_and_zero_is_a_value():
    env = {"AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT": "0.5", "AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA": "0",
           "AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE": "0", "AIBRIX_LOAD_BALANCE_IMBALANCE_FACTOR": "3",
           "AIBRIX_LOAD_BALANCE_IMBALANCE_MIN_GAP": "0", "AIBRIX_ROUTING_AUTO_BLEND_LOAD_BALANCE_WEIGHT": "0",
           "AIBRIX_ROUTING_AUTO_BLEND_LEAST_REQUEST_WEIGHT": "2",
           "AIBRIX_ROUTING_AUTO_BLEND_PREFIX_CACHE_WEIGHT": "0",
           "AIBRIX_ROUTING_AUTO_BLEND_PREFIX_CACHE_LOAD_BALANCE_WEIGHT": "7"}
    s = parse(BASE, env).routing_settings
    assert s.load_balance == LoadBalanceSettings(0.5, 0.0, 0.0, 3.0, 0.0)
    assert s.auto_blend == AutoBlendSettings(0, 2, 0, 7)


def test_our_variable_beats_the_aibrix_alias_which_beats_the_file():
    raw = {**BASE, "routing": {"default_strategy": "random", "load_balance": {"kv_pressure_alpha": 1.0}}}
    assert parse(raw, {}).routing_settings.load_balance.kv_pressure_alpha == 1.0
    env = {"AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA": "3"}
    assert parse(raw, env).routing_settings.load_balance.kv_pressure_alpha == 3.0
    env["EXTPROC_LOAD_BALANCE_KV_PRESSURE_ALPHA"] = "4"
    assert parse(raw, env).routing_settings.load_balance.kv_pressure_alpha == 4.0
    # the default strategy likewise, whatever order the variables come in
    for env in ({"ROUTING_ALGORITHM": "random", "EXTPROC_DEFAULT_STRATEGY": "least-request"},
                {"EXTPROC_DEFAULT_STRATEGY": "least-request", "ROUTING_ALGORITHM": "random",
                 "AIBRIX_ROUTING_ALGORITHM": "random"}):
        assert parse(BASE, env).default_strategy == "least-request"
    assert parse(BASE, {"ROUTING_ALGORITHM": "random"}).default_strategy == "random"


def test_per_model_routing_config_overrides_only_what_it_sets():
    raw = {**with_model_routing({"loadBalance": {"kvCriticalFree": 0.2, "imbalanceMinGap": 0},
                                 "autoBlend": {"leastRequestWeight": 0}}),
           "routing": {"load_balance": {"kv_pressure_alpha": 1.5}}}
    s = parse(raw, {}).routing_settings
    model = s.for_model("m")
    assert model.load_balance == LoadBalanceSettings(0.0, 1.5, 0.2, 2.0, 0.0)
    assert model.auto_blend == AutoBlendSettings(1, 0, 5, 4)
    assert s.for_model("other").load_balance == s.load_balance


def test_max_num_seqs_from_file_env_and_per_model():
    s = parse({**BASE, "routing": {"load_balance": {"max_num_seqs": 128}}}, {}).routing_settings
    assert s.load_balance.max_num_seqs == 128 and LoadBalanceSettings().max_num_seqs == 256
    env = parse(BASE, {"EXTPROC_LOAD_BALANCE_MAX_NUM_SEQS": "64"}).routing_settings
    assert env.load_balance.max_num_seqs == 64
    model = parse(with_model_routing({"loadBalance": {"maxNumSeqs": 0}}), {}).routing_settings.for_model("m")
    assert model.load_balance.max_num_seqs == 0


def test_a_default_blend_is_accepted():
    assert parse({**BASE, "routing": {"default_strategy": "Least-Request:2, load-balance:1"}}, {}).default_strategy \
        == "least-request:2, load-balance:1"


@pytest.mark.parametrize("raw,env,names", [
    ({**BASE, "routing": {"default_strategy": "nope"}}, {}, "'nope'"),
    ({**BASE, "routing": {"default_strategy": "load-balance:0"}}, {}, "weight 0"),
    ({**BASE, "routing": {"default_strategy": "random,least-request"}}, {}, "cannot be blended"),
    (BASE, {"ROUTING_ALGORITHM": "fastest"}, "'fastest'"),
    ({**BASE, "routing": {"seed": "x"}}, {}, "routing.seed"),
    ({**BASE, "routing": {"cache_size": 0}}, {}, "routing.cache_size"),
    ({**BASE, "routing": {"strategy": "random"}}, {}, "routing.strategy"),
    ({**BASE, "routing": {"load_balance": {"kv_critical_free": 1.5}}}, {}, "routing.load_balance.kv_critical_free"),
    ({**BASE, "routing": {"load_balance": {"queued_weight": -1}}}, {}, "routing.load_balance.queued_weight"),
    ({**BASE, "routing": {"load_balance": {"kv_pressure_alpha": float("nan")}}}, {}, "kv_pressure_alpha"),
    ({**BASE, "routing": {"load_balance": {"alpha": 1}}}, {}, "routing.load_balance.alpha"),
    ({**BASE, "routing": {"load_balance": {"max_num_seqs": 25.5}}}, {}, "routing.load_balance.max_num_seqs"),
    ({**BASE, "routing": {"load_balance": {"max_num_seqs": -1}}}, {}, "routing.load_balance.max_num_seqs"),
    (with_model_routing({"loadBalance": {"maxNumSeqs": "256"}}), {},
     "models.m.routingConfig.loadBalance.maxNumSeqs"),
    ({**BASE, "routing": {"load_balance": 3}}, {}, "routing.load_balance"),
    ({**BASE, "routing": {"auto_blend": {"load_balance_weight": 1.5}}}, {}, "routing.auto_blend.load_balance_weight"),
    ({**BASE, "routing": {"auto_blend": {"least_request_weight": 1000001}}}, {}, "least_request_weight"),
    ({**BASE, "routing": {"auto_blend": {"prefix_cache_weight": True}}}, {}, "prefix_cache_weight"),
    (BASE, {"AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE": "2"}, "AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE"),
    (BASE, {"EXTPROC_LOAD_BALANCE_IMBALANCE_FACTOR": "inf"}, "EXTPROC_LOAD_BALANCE_IMBALANCE_FACTOR"),
    (BASE, {"AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT": "lots"}, "AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT"),
    (BASE, {"AIBRIX_ROUTING_AUTO_BLEND_LOAD_BALANCE_WEIGHT": "1.0"}, "AIBRIX_ROUTING_AUTO_BLEND_LOAD_BALANCE_WEIGHT"),
    (BASE, {"AIBRIX_ROUTING_AUTO_BLEND_LEAST_REQUEST_WEIGHT": "-1"}, "AIBRIX_ROUTING_AUTO_BLEND_LEAST_REQUEST_WEIGHT"),
    (with_model_routing({"loadBalance": {"kvCriticalFree": -0.1}}), {}, "models.m.routingConfig.loadBalance.kvCriticalFree"),
    (with_model_routing({"loadBalance": {"kv_critical_free": 0.1}}), {}, "models.m.routingConfig.loadBalance.kv_critical_free"),
    (with_model_routing({"autoBlend": {"loadBalanceWeight": "1"}}), {}, "models.m.routingConfig.autoBlend.loadBalanceWeight"),
    (with_model_routing({"pd": {}}), {}, "models.m.routingConfig.pd"),
    (with_model_routing([1]), {}, "models.m.routingConfig"),
])
def test_a_bad_setting_refuses_the_config_and_names_the_key(raw, env, names):
    with pytest.raises(ConfigError) as err:
        parse(raw, env)
    assert names in str(err.value)


def test_routing_settings_are_parsed_once_and_replaceable():
    # parsed at load, not on every access; the fleet simulation gives each simulated gateway its own seed
    c = parse({**BASE, "routing": {"seed": 1}}, {})
    assert c.routing_settings is c.routing_settings and c.routing_settings.seed == 1
    assert config_with_seed(c, 2).routing_settings.seed == 1 * 1009 + 2


def test_every_knob_has_both_spellings():
    names = set(env_variables())
    assert {"AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE", "EXTPROC_LOAD_BALANCE_KV_CRITICAL_FREE",
            "AIBRIX_ROUTING_AUTO_BLEND_PREFIX_CACHE_LOAD_BALANCE_WEIGHT"} <= names and len(names) == 20
