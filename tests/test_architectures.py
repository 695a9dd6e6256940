"""The one architecture table (``pagefold/architectures.py``) and its readers agree."""

from __future__ import annotations

import pytest

from pagefold.architectures import (
    ARCHITECTURES,
    MODEL_TYPES,
    resolve_architecture,
    served_architectures,
    tensor_parallel_architectures,
)
from pagefold.core.spec_families import FAMILY_READERS
from pagefold.core.spec_from_config import BASE_FAMILIES, detect_family
from pagefold.models.registry import model_class

SPEC_ONLY = {"Qwen3MoeForCausalLM"}


def test_every_family_has_exactly_one_reader():
    named = {e.family for e in ARCHITECTURES.values()} | set(MODEL_TYPES.values())
    assert named == BASE_FAMILIES | set(FAMILY_READERS)
    assert not BASE_FAMILIES & set(FAMILY_READERS)


def test_served_architectures_build_their_class():
    assert set(ARCHITECTURES) - set(served_architectures()) == SPEC_ONLY
    for arch in served_architectures():
        assert model_class(arch).__name__ == arch
    for arch in SPEC_ONLY:
        with pytest.raises(KeyError):
            model_class(arch)
    assert tensor_parallel_architectures() == served_architectures()


def test_resolve_architecture_takes_the_first_served():
    assert resolve_architecture(
        {"architectures": ["Qwen3MoeForCausalLM", "BambaForCausalLM", "LlamaForCausalLM"]}
    ) == "BambaForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture.*pagefold supports: "
                                         "BambaForCausalLM, FalconH1ForCausalLM"):
        resolve_architecture({"architectures": ["Qwen3MoeForCausalLM"]})


@pytest.mark.parametrize("config, family", [
    ({"model_type": "bamba"}, "bamba"),
    ({"architectures": ["GraniteMoeHybridForCausalLM"]}, "granite"),
    ({"model_type": "gemma3_text"}, "gemma3"),
    ({"text_config": {"model_type": "qwen3_5_text"}, "model_type": "qwen3_5"}, "gdn"),
    ({"architectures": ["Qwen3_5MoeForCausalLM"]}, "gdn"),
    # a later family named anywhere wins over a first-hybrid family
    ({"model_type": "llama", "architectures": ["JambaForCausalLM"]}, "jamba"),
    # model_type before architectures within one reader's families
    ({"model_type": "qwen2", "architectures": ["NemotronHForCausalLM"]}, "attention"),
])
def test_family_detection(config, family):
    assert detect_family(config) == family


def test_unknown_family_lists_the_table():
    with pytest.raises(ValueError, match=r"supported model types: llama, qwen2, .*, gpt_oss; "
                                         r"supported architectures: LlamaForCausalLM, .*"
                                         r"GptOssForCausalLM$"):
        detect_family({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
