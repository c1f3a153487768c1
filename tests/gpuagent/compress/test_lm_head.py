"""`quantize_lm_head` on a model whose head is its own tensor (untied): the head is
quantized, named in no ignore list, read back by compressed-tensors within rounding,
and run by the engine as a quantized Linear; on a tied head the option is refused."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpuagent.compress import compress
from gpuagent.compress.recipes import RecipeError
from gpuagent.engine.loader import load_model
from gpuagent.engine.weights import QuantLinear
from tests.gpuagent.compress.conftest import DEMO_MODEL
from tests.gpuagent.compress.test_oracle import _decompressed

RECIPE = {"weights": "w8a16", "kv_cache_dtype": "bf16", "quantize_lm_head": True}


@pytest.fixture
def untied_demo(tmp_path):
    """The demo model with an lm_head of its own: the embeddings plus noise, so
    that a head read from the embeddings would be caught."""
    folder = tmp_path / "untied"
    shutil.copytree(DEMO_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    noise = torch.randn(embed.shape, generator=torch.Generator().manual_seed(0))
    tensors["lm_head.weight"] = embed + 0.5 * embed.std() * noise
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_it_quantizes_an_untied_head(untied_demo, tmp_path):
    out = tmp_path / "out"
    result = compress(untied_demo, RECIPE, out)
    source = load_file(untied_demo / "model.safetensors")
    qc, modules = _decompressed(out)
    tokens = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))

    assert qc.ignore == []
    assert result.quantized_layers == 4 * 7 + 1
    head, state = modules["lm_head"]
    original = source["lm_head.weight"].float()
    step = state["weight_scale"].float()  # [vocab, 1]: one scale per output row
    # half a step (and the clamp of a row maximum whose bf16 scale rounded down),
    # plus compressed-tensors' bf16 rounding of its product
    bound = step * (0.5 + 2**-5) + original.abs() * 2**-8
    assert ((head.float() - original).abs() <= bound + 1e-7).all()
    assert not torch.equal(head.float(), source["model.embed_tokens.weight"].float())
    model = load_model(out)
    assert isinstance(model.lm_head, QuantLinear)
    with torch.no_grad():
        ref = load_model(untied_demo).forward_dense(tokens).log_softmax(-1)
        cand = model.forward_dense(tokens).log_softmax(-1)
    kld = (ref.exp() * (ref - cand)).sum(-1).mean().item()
    assert kld < 0.01


def test_it_refuses_to_quantize_a_tied_head(tmp_path):
    with pytest.raises(RecipeError, match="tie_word_embeddings"):
        compress(DEMO_MODEL, RECIPE, tmp_path / "out")
    assert not (tmp_path / "out").exists()
