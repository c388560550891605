"""The decoder's own mechanics (``executor/models/decoder.py``), where a bug would hide behind
the end-to-end checks: checkpoint tensors land in the right rows of the fused projections, a
missing or misshapen one is an error that names it, and Gemma's embedding scale and per-layer
RoPE tables are applied."""

from __future__ import annotations

import logging

import pytest
import torch

from asyncengine.executor.models.decoder import CausalLM
from tests.utils import tiny_config


def checkpoint(model: CausalLM, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under transformers' names: q/k/v and gate/up split, as checkpoints
    store them."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if ".qkv_proj." in name:
            attn = model.get_submodule(name.rsplit(".", 2)[0])
            for shard in ("q", "k", "v"):
                _, rows = attn.shard_rows(shard)
                out[name.replace("qkv_proj", f"{shard}_proj")] = torch.randn(
                    rows, *param.shape[1:], generator=gen)
        elif ".gate_up_proj." in name:
            half = param.shape[0] // 2
            for shard in ("gate", "up"):
                out[name.replace("gate_up_proj", f"{shard}_proj")] = torch.randn(
                    half, *param.shape[1:], generator=gen)
        else:
            out[name] = torch.randn(param.shape, generator=gen)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_shards_land_in_their_rows(family):
    model = CausalLM(tiny_config(family, vocab_size=64))
    ckpt = checkpoint(model)
    model.load_weights(ckpt.items())
    layer = model.model.layers[1]
    p = "model.layers.1."
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(
        [ckpt[p + f"self_attn.{s}_proj.weight"] for s in "qkv"]))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(
        [ckpt[p + f"mlp.{s}_proj.weight"] for s in ("gate", "up")]))
    if family == "qwen2":  # q/k/v biases too
        assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat(
            [ckpt[p + f"self_attn.{s}_proj.bias"] for s in "qkv"]))


def test_a_missing_shard_or_a_wrong_shape_is_named():
    model = CausalLM(tiny_config("llama", vocab_size=64))
    ckpt = checkpoint(model)
    del ckpt["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.0\.self_attn\.qkv"):
        CausalLM(tiny_config("llama", vocab_size=64)).load_weights(ckpt.items())
    ckpt = checkpoint(model)
    ckpt["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"up_proj\.weight has shape \(3, 3\)"):
        model.load_weights(ckpt.items())


def test_extra_tensors_are_skipped_the_image_side_quietly(caplog):
    model = CausalLM(tiny_config("llama", vocab_size=64))
    ckpt = checkpoint(model)
    ckpt["vision_tower.blocks.0.weight"] = torch.zeros(2)
    ckpt["model.layers.0.mystery.weight"] = torch.zeros(2)
    with caplog.at_level(logging.WARNING):
        model.load_weights(ckpt.items())
    warned = [r.message for r in caplog.records]
    assert warned == ["ignoring checkpoint tensor model.layers.0.mystery.weight "
                      "(no such parameter)"]


def test_gemma_scales_its_embeddings_and_rotates_each_layer_with_its_table():
    config = tiny_config("gemma3", vocab_size=64)
    model = CausalLM(config)
    model.load_weights(checkpoint(model).items())
    ids = torch.tensor([3, 5, 7])
    assert torch.allclose(model.embed(ids),
                          model.model.embed_tokens.weight[ids] * config.hidden_size ** 0.5)
    tables = model.rope_tables(torch.arange(3), torch.float32)
    assert set(tables) == {layer.rope for layer in model.spec.layers}
    assert len(tables) == 2  # local and global bases
    local, full = (tables[name][0] for name in ("sliding_attention", "full_attention"))
    assert not torch.equal(local, full)
