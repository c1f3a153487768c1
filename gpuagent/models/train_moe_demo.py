"""Train the MoE demo model that ships in `gpuagent/engine/moe_demo_model/`.

    nice -n 10 python -m gpuagent.models.train_moe_demo \
        --out gpuagent/engine/moe_demo_model --seed 0

A tiny DeepSeek-V3 (`model_type: deepseek_v3`, `DeepseekV3ForCausalLM`): MLA
attention (q_lora_rank, kv_lora_rank, decoupled RoPE key), one dense layer
(`first_k_dense_replace: 1`), then MoE layers with 8 routed experts in 4 groups
(2 groups kept per token, `n_group`/`topk_group`), 2 experts per token, one shared
expert, the sigmoid router with its score-correction bias and a routed scaling
factor. Byte tokenizer and corpus are the demo Llama's (`train_demo`, `corpus`), so
the two demo models are scored on the same held-out text.

The model trained is the engine's own `arch.MoETransformer` (dense path). As in
DeepSeek-V3, experts are balanced without an auxiliary loss: after each optimizer
step every MoE layer's `e_score_correction_bias` moves by `--bias-update-speed`
toward the experts that received fewer than the mean number of tokens in that step
(b_i += gamma * sign(mean load - load_i)); the bias only chooses experts, it never
weights their output. The training report records each layer's held-out expert
load.

Saved as the published checkpoints are: bf16 tensors (the router's correction bias
in float32), per-expert tensor names, sharded safetensors with
`model.safetensors.index.json`. Deterministic from --seed and --threads (sorted
sources, seeded generator, deterministic algorithms, a fixed number of steps); the
corpus is checked against the committed report first (`train_demo.check_corpus`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from gpuagent.engine.arch import MoEConfig, MoETransformer
from gpuagent.engine.moe import SigmoidRouter
from gpuagent.engine.tokenizer import BYTE_VOCAB_SIZE, save_byte_tokenizer
from gpuagent.models.corpus import (
    DOMAINS,
    Corpus,
    build_corpus,
    corpus_digests,
    encode_bytes,
    heldout_texts,
)
from gpuagent.models.train_demo import (
    BOS_ID,
    EOS_ID,
    bits_per_byte,
    check_corpus,
    lr_at,
    read_committed_report,
    sample_batch,
)

COMMITTED_DIR = Path(__file__).resolve().parents[1] / "engine" / "moe_demo_model"
INDEX_FILE = "model.safetensors.index.json"
# tensors kept in float32 in the checkpoint, as DeepSeek-V3's published one does
FP32_TENSORS = (".mlp.gate.e_score_correction_bias",)


def moe_demo_hf_config() -> dict:
    """The `config.json` written for the MoE demo, in DeepSeek-V3's published keys."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 384,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rope_interleave": True,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def moe_demo_config() -> MoEConfig:
    """The MoE demo's architecture, as the engine reads its config.json."""
    return MoEConfig.from_hf_config(moe_demo_hf_config())


def init_weights(model: MoETransformer) -> None:
    """N(0, 0.02) for matrices, residual outputs scaled by depth; norms stay 1 and
    correction biases 0."""
    layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if p.dim() == 1:
            continue
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std = 0.02 / math.sqrt(2 * layers)
        torch.nn.init.normal_(p, mean=0.0, std=std)


class ExpertLoad:
    """Counts tokens per routed expert of every MoE layer (forward hooks on the
    routers), between `reset` calls."""

    def __init__(self, model: MoETransformer) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, SigmoidRouter)]
        self.counts = [torch.zeros(r.config.num_experts) for r in self.routers]
        for router, counts in zip(self.routers, self.counts, strict=True):
            router.register_forward_hook(self._hook(counts))

    @staticmethod
    def _hook(counts: torch.Tensor):
        def record(_module, _inputs, output) -> None:
            _, ids = output  # [T, k]
            counts.add_(torch.bincount(ids.flatten(), minlength=len(counts)).float())

        return record

    def reset(self) -> None:
        for counts in self.counts:
            counts.zero_()

    @torch.no_grad()
    def update_biases(self, speed: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing step on the counts so far."""
        for router, counts in zip(self.routers, self.counts, strict=True):
            router.e_score_correction_bias += speed * torch.sign(counts.mean() - counts)

    def shares(self) -> list[list[float]]:
        """Per layer, each expert's share of the routed (token, slot) pairs."""
        return [(c / c.sum().clamp_min(1)).tolist() for c in self.counts]


def train(
    seed: int,
    steps: int,
    batch: int,
    seq_len: int,
    peak_lr: float,
    bias_update_speed: float,
    log_every: int,
    corpus: Corpus | None = None,
    hf_config: dict | None = None,
) -> tuple[MoETransformer, dict]:
    """Train the MoE demo from scratch; returns it and the corpus/training stats."""
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    if corpus is None:
        corpus = build_corpus()
    data = corpus.ids
    model = MoETransformer(MoEConfig.from_hf_config(hf_config or moe_demo_hf_config()))
    init_weights(model)
    load = ExpertLoad(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay}],
        lr=peak_lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )
    gen = torch.Generator().manual_seed(seed)
    started = time.monotonic()
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup=max(1, steps // 20))
        xy = sample_batch(data, batch, seq_len, gen)  # [batch, seq_len + 1]
        load.reset()
        logits = model.forward_dense(xy[:, :-1])  # [batch, seq_len, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), xy[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        load.update_biases(bias_update_speed)
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            busiest = max(max(s) for s in load.shares())
            print(
                f"step {step:5d}/{steps}  loss {recent:.3f}  "
                f"({recent / math.log(2):.2f} bits/byte)  "
                f"busiest expert {busiest:.1%}  {time.monotonic() - started:6.0f}s",
                flush=True,
            )
    stats = {
        "seed": seed,
        "steps": steps,
        "batch": batch,
        "seq_len": seq_len,
        "peak_lr": peak_lr,
        "bias_update_speed": bias_update_speed,
        "train_tokens_seen": steps * batch * seq_len,
        "train_seconds": round(time.monotonic() - started, 1),
        "torch_threads": torch.get_num_threads(),
        "train_tokens_per_domain": {d: len(data[d]) for d in DOMAINS},
        "corpus_sha256": corpus_digests(data),
        "korean_catalogs": len(corpus.korean_catalogs),
        "corpus_sources": corpus.sources,
        "final_train_loss_bits": sum(losses[-20:]) / len(losses[-20:]) / math.log(2),
    }
    return model, stats


# ---------------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_expert_load(
    model: MoETransformer, text: str, max_bytes: int = 16384
) -> list[list[float]]:
    """Per MoE layer, each routed expert's share of held-out (token, slot) pairs."""
    load = ExpertLoad(model)
    ids = encode_bytes(text)[:max_bytes]
    for start in range(0, len(ids) - 1, 512):
        model.forward_dense(ids[start : start + 512][None])
    return load.shares()


def unigram_bits_per_byte(train_ids: dict[str, torch.Tensor], text: str) -> float:
    """Bits per byte of `text` under the training split's byte frequencies (add-one):
    the baseline a trained model must beat by a wide margin."""
    counts = torch.ones(BYTE_VOCAB_SIZE)
    for ids in train_ids.values():
        counts += torch.bincount(ids, minlength=BYTE_VOCAB_SIZE).float()
    logp = (counts / counts.sum()).log2()
    data = torch.tensor(list(text.encode("utf-8")))
    return float(-logp[data].mean())


# -------------------------------------------------------------------------- saving


def hf_state_dict(model: MoETransformer) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3 names and dtypes: bf16, the correction biases in float32."""
    out = {}
    for name, tensor in model.state_dict().items():
        key = name if name == "lm_head.weight" else "model." + name
        dtype = torch.float32 if key.endswith(FP32_TENSORS) else torch.bfloat16
        out[key] = tensor.to(dtype).contiguous().clone()
    return out


def save_sharded(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    """Write `tensors` as `num_shards` safetensors files (whole decoder layers per
    shard, in order) and the index mapping each tensor to its file."""
    names = sorted(tensors)

    def layer_of(name: str) -> int:
        parts = name.split(".")
        return int(parts[2]) if name.startswith("model.layers.") else -1

    layers = sorted({layer_of(n) for n in names})
    per_shard = math.ceil(len(layers) / num_shards)
    files = [
        f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)
    ]
    weight_map = {}
    for name in names:
        weight_map[name] = files[
            min(layers.index(layer_of(name)) // per_shard, num_shards - 1)
        ]
    total = 0
    for file in files:
        part = {n: tensors[n] for n in names if weight_map[n] == file}
        save_file(part, str(out / file), {"format": "pt"})
        (out / file).chmod(0o644)  # save_file writes 0600
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def save_model_folder(
    model: MoETransformer, hf_config: dict, out: Path, report: dict, num_shards: int = 2
) -> None:
    """Write config, sharded weights, tokenizer, generation config and report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_sharded(hf_state_dict(model), out, num_shards)
    save_byte_tokenizer(out)
    generation = {
        "bos_token_id": hf_config["bos_token_id"],
        "eos_token_id": hf_config["eos_token_id"],
        "max_length": hf_config["max_position_embeddings"],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    report["safetensors_bytes"] = sum(
        p.stat().st_size for p in out.glob("*.safetensors")
    )
    text = json.dumps(report, indent=2, ensure_ascii=False)
    (out / "training_report.json").write_text(text + "\n")


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: train, evaluate held-out bpb and expert load, save."""
    parser = argparse.ArgumentParser(
        prog="python -m gpuagent.models.train_moe_demo",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--out", type=Path, default=COMMITTED_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--bias-update-speed", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-bytes", type=int, default=32768)
    parser.add_argument("--allow-different-corpus", action="store_true")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    corpus = build_corpus()
    check_corpus(
        corpus,
        read_committed_report(COMMITTED_DIR),
        args.out,
        args.allow_different_corpus,
        COMMITTED_DIR,
    )
    hf_config = moe_demo_hf_config()
    model, stats = train(
        args.seed,
        args.steps,
        args.batch,
        args.seq_len,
        args.lr,
        args.bias_update_speed,
        20,
        corpus,
        hf_config,
    )
    model.eval()
    heldout = heldout_texts()
    bpb = {
        d: bits_per_byte(model, heldout[d], max_bytes=args.eval_bytes) for d in DOMAINS
    }
    unigram = {
        d: unigram_bits_per_byte(corpus.ids, heldout[d][: args.eval_bytes])
        for d in DOMAINS
    }
    print("\nheld-out bits per byte (chance = 8.00)")
    print(f"{'domain':<10}{'model':>8}{'unigram':>9}")
    for d in DOMAINS:
        print(f"{d:<10}{bpb[d]:>8.3f}{unigram[d]:>9.3f}")
    shares = heldout_expert_load(model, "".join(heldout[d][:8192] for d in DOMAINS))
    print("\nheld-out expert load (share of routed token slots; uniform = 12.5%)")
    for i, layer in enumerate(shares):
        row = " ".join(f"{s:6.1%}" for s in layer)
        print(f"layer {i + hf_config['first_k_dense_replace']}: {row}")
    report = {
        "heldout_bits_per_byte": {d: round(v, 4) for d, v in bpb.items()},
        "heldout_unigram_bits_per_byte": {d: round(v, 4) for d, v in unigram.items()},
        "heldout_eval_bytes": args.eval_bytes,
        "heldout_expert_load": [[round(s, 4) for s in layer] for layer in shares],
        "num_parameters": model.num_parameters(),
        **stats,
    }
    save_model_folder(model, hf_config, args.out, report)
    size_mb = report["safetensors_bytes"] / 1e6
    print(f"\n{model.num_parameters():,} parameters, {size_mb:.2f} MB -> {args.out}")


if __name__ == "__main__":
    main()
