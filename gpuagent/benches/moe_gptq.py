"""Per-expert GPTQ vs round-to-nearest on a random tiny MoE model, one run, ratios
side by side: `python -m gpuagent.benches.moe_gptq [--weights w4a16-g128]`.

For each architecture (DeepSeek-V3: MLA + MoE; GLM-4.5: GQA + MoE) a random tiny
model is written by transformers (`save_pretrained`, per-expert tensors as the
published checkpoints) with the byte tokenizer, and compressed twice under the
same format: RTN, and GPTQ (each routed expert's Hessian from the calibration
tokens its router sends it, `gpuagent.compress.moe`). On held-out text (the
calibration windows after those compression used) the source model gives each
MoE layer's MLP input; the source router groups its tokens per expert, and each
expert's outputs on its own tokens are computed with the source weights and with
each candidate's (the engine's QuantLinear, float32 reference arithmetic). Printed:
relative error ||Y_q - Y|| / ||Y|| over all (token, expert) pairs per layer, and
GPTQ / RTN. The first row is like-for-like (RTN against itself: 1.000).
Information, not a gate: the weights are random, real checkpoints differ.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from gpuagent.compress.calibration import calibration_sequences
from gpuagent.compress.pipeline import compress
from gpuagent.engine.loader import load_model
from gpuagent.engine.tokenizer import load_tokenizer, save_byte_tokenizer

CALIBRATION = (16, 128)  # sequences, tokens: what compression calibrates on
HELD_OUT = 8  # further sequences of the same length, scored

COMMON = dict(
    vocab_size=264,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    initializer_range=0.05,
)


def build(arch: str, folder: Path, **overrides) -> None:
    """A random tiny model of `arch` saved to `folder` with the byte tokenizer
    (`overrides`: config values other than COMMON's)."""
    import transformers

    torch.manual_seed(0)
    common = COMMON | overrides
    if arch == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            kv_lora_rank=64,
            q_lora_rank=128,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
        )
        model = transformers.DeepseekV3ForCausalLM(config)
    else:
        config = transformers.Glm4MoeConfig(
            **common, num_key_value_heads=2, head_dim=32, num_experts_per_tok=2
        )
        model = transformers.Glm4MoeForCausalLM(config)
    with torch.no_grad():  # a correction bias that matters, as trained ones do
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape))
    model.eval().save_pretrained(folder, safe_serialization=True)
    save_byte_tokenizer(folder)


def mlp_inputs(model, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each MoE layer's MLP input [N, hidden] on tokens [B, T] (source model)."""
    positions = torch.arange(tokens.shape[1])
    cos, sin = model._rope(positions)
    h = model.embed_tokens(tokens)
    out = {}
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            x = h + layer.self_attn.forward_dense(layer.input_layernorm(h), cos, sin)
            if hasattr(layer.mlp, "experts"):
                out[i] = layer.post_attention_layernorm(x).reshape(-1, x.shape[-1])
            h = layer.forward_dense(h, cos, sin)
    return out


def expert_errors(source, candidate, inputs) -> dict[int, tuple[float, float]]:
    """layer -> (sum of squared error, sum of squared reference) of the routed
    experts' outputs over their own tokens (the source router's choice)."""
    out = {}
    with torch.no_grad():
        for i, x in inputs.items():
            _, ids = source.layers[i].mlp.gate(x)
            err = ref = 0.0
            for e, expert in enumerate(source.layers[i].mlp.experts):
                rows = x[(ids == e).any(dim=-1)]
                if not len(rows):
                    continue
                y = expert(rows)
                y_q = candidate.layers[i].mlp.experts[e](rows)
                err += float((y_q - y).square().sum())
                ref += float(y.square().sum())
            out[i] = (err, ref)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="w4a16-g128")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    print(f"{'arch':12} {'layer':>5} {'row':22} {'rel err':>9} {'vs RTN':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("deepseek_v3", "glm4_moe"):
            src = Path(tmp) / arch
            build(arch, src)
            results, folders = {}, {}
            for method in ("rtn", "gptq"):
                folders[method] = Path(tmp) / f"{arch}-{method}"
                recipe = {"weights": args.weights, "kv_cache_dtype": "bf16"}
                results[method] = compress(
                    src,
                    {**recipe, "method": method},
                    folders[method],
                    calibration_size=CALIBRATION,
                )
            tokenizer = load_tokenizer(src)
            n, length = CALIBRATION
            held_out = calibration_sequences(tokenizer, n + HELD_OUT, length)[n:]
            source = load_model(src)
            inputs = mlp_inputs(source, torch.tensor(held_out))
            errors = {
                m: expert_errors(source, load_model(f), inputs)
                for m, f in folders.items()
            }
            fallback = results["gptq"].rtn_fallback_experts
            for i in inputs:
                rtn_err, ref = errors["rtn"][i]
                gptq_err = errors["gptq"][i][0]
                rtn = (rtn_err / ref) ** 0.5
                gptq = (gptq_err / ref) ** 0.5
                fell = sum(f.layer == i for f in fallback)
                rows = (
                    ("RTN (like-for-like)", rtn, rtn),
                    (f"GPTQ ({fell} expert(s) RTN)", gptq, rtn),
                )
                for name, value, base in rows:
                    print(
                        f"{arch:12} {i:>5} {name:22} {value:9.4f} {value / base:7.3f}"
                    )
            total = {m: sum(e for e, _ in errs.values()) for m, errs in errors.items()}
            print(
                f"{arch:12} {'all':>5} {'GPTQ / RTN sq. error':22} "
                f"{'':9} {total['gptq'] / total['rtn']:7.3f}"
            )


if __name__ == "__main__":
    main()
