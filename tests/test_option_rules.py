"""Option rules that need no model: the dict-or-JSON options and the feature combinations
``EngineConfig`` refuses before anything is built."""

import pytest

from pagefold.config import EngineConfig

JSON_OPTIONS = [
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    ("kv_transfer_config", {"kv_connector": "PagefoldConnector", "kv_role": "kv_both",
                            "engine_id": "e1"}),
    ("limit_mm_per_prompt", {"image": 2}),
]


@pytest.mark.parametrize("name,good", JSON_OPTIONS)
def test_dict_or_json_options_parse_alike(name, good):
    import json

    as_dict = EngineConfig(model="m", **{name: good})
    as_text = EngineConfig(model="m", **{name: json.dumps(good)})
    assert getattr(as_dict, name) == getattr(as_text, name)
    assert getattr(as_dict, name) is not None
    with pytest.raises(ValueError, match=rf"^{name} is not valid JSON: "):
        EngineConfig(model="m", **{name: "{not json"})
    with pytest.raises(ValueError, match=rf"^{name} must be a dict or a JSON object, got list"):
        EngineConfig(model="m", **{name: "[1, 2]"})
    with pytest.raises(ValueError, match=rf"^{name} must be a dict or a JSON object, got int"):
        EngineConfig(model="m", **{name: 3})


@pytest.mark.parametrize("kwargs,what", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "speculative decoding"),
    ({"kv_offloading_size": 0.5}, "the prefix-cache offload tiers"),
    ({"kv_offloading_dir": "/tmp/x"}, "the prefix-cache offload tiers"),
    ({"kv_transfer_config": {"kv_connector": "PagefoldConnector", "kv_role": "kv_producer"}},
     "kv_transfer_config"),
    ({"enable_lora": True}, "enable_lora"),
])
def test_pipeline_stages_refuse_whole_model_features(kwargs, what):
    EngineConfig(model="m", **kwargs)  # fine on one stage
    with pytest.raises(ValueError, match=rf"^{what}.* needs pipeline_parallel_size 1, got 2$"):
        EngineConfig(model="m", pipeline_parallel_size=2, **kwargs)
    EngineConfig(model="m", pipeline_parallel_size=2)  # and the stages alone are fine


def test_lora_with_speculation_is_refused():
    with pytest.raises(ValueError, match="enable_lora with speculative_config"):
        EngineConfig(model="m", enable_lora=True,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
