"""Static KV scales (the fp8 layout): per layer and per kv head, the absmax of
K and V as the model writes them into the cache (in the Hadamard basis, as that
layout is rotated) over calibration text, divided by 448, as vLLM's k_scale/v_scale.

A checkpoint that carries its own scales (compressed-tensors' kv_cache_scheme, vLLM's
convention: `model.layers.N.self_attn.k_scale` / `v_scale`, a scalar or one per kv
head, dequantized value = fp8 code * scale) is served with them instead of
calibrating; they were computed on unrotated K/V, so its caches stay unrotated.

The calibration text is built in (English prose, Python code, Korean), and is none of
the bench's evaluation text. Values beyond a calibrated absmax saturate at +-448.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import kernels
from gpuagent.engine import kv_int4c
from gpuagent.engine.mla import calibrate_latent_scales, is_mla
from gpuagent.engine.model import AttentionMetadata

FP8_MAX = 448.0
CALIBRATION_TEXTS = (
    "Rivers carry the rain of a whole valley down to the sea. Along the way they cut "
    "their beds into the rock, leave sand and gravel where the current slows, and "
    "feed the fields and towns that grew up on their banks. In spring the water "
    "rises with the melting snow; in late summer it can fall so low that children "
    "walk across stones that were hidden a few months before. Engineers who build "
    "bridges and dams study these seasons for years before they draw a single line.",
    "import json\nfrom pathlib import Path\n\n\nclass Inventory:\n"
    "    def __init__(self, path: Path) -> None:\n        self.path = path\n"
    "        self.items: dict[str, int] = {}\n\n"
    "    def load(self) -> None:\n        if self.path.exists():\n"
    "            self.items = json.loads(self.path.read_text())\n\n"
    "    def add(self, name: str, count: int = 1) -> int:\n"
    "        self.items[name] = self.items.get(name, 0) + count\n"
    "        return self.items[name]\n",
    "서울의 겨울은 춥고 건조하지만, 봄이 오면 거리마다 벚꽃이 피어 많은 사람들이 "
    "공원으로 나온다. 설정 파일을 저장하지 못했습니다. 디스크 공간을 확인한 뒤 다시 "
    "시도하십시오. 회의는 다음 주 화요일 오후 세 시에 시작합니다.",
)


def calibration_sequences(tokenizer, max_tokens: int = 256) -> list[list[int]]:
    """The calibration texts as the engine encodes prompts."""
    return [tokenizer.encode_prompt(text)[:max_tokens] for text in CALIBRATION_TEXTS]


def static_kv_scales(
    model, sequences: Sequence[list[int]], rotated: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(key_scale [KVH], value_scale [KVH]) float32 per layer: absmax / 448 of what
    the model writes into a cache (rotated or not) over `sequences`."""
    config = model.config
    device = next(model.parameters()).device
    heads, dim = config.num_key_value_heads, config.head_dim
    absmax = torch.zeros(config.num_hidden_layers, 2, heads, device=device)
    for ids in sequences:
        n = len(ids)
        # One prefill into float32 caches laid out like the target (rotated).
        caches = [
            kernels.allocate_kv_cache(
                "fp32", n, 1, heads, dim, device=device, rotated=rotated
            )
            for _ in range(config.num_hidden_layers)
        ]
        attn = AttentionMetadata(
            slot_mapping=torch.arange(n, device=device),
            block_tables=torch.arange(n, dtype=torch.int32, device=device)[None],
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
            context_lens=torch.tensor([n], dtype=torch.int32, device=device),
            decode_only=n == 1,
        )
        with torch.inference_mode():
            model(
                torch.tensor(ids, device=device),
                torch.arange(n, device=device),
                caches,
                attn,
            )
        for layer, cache in enumerate(caches):
            for which, store in enumerate((cache.key, cache.value)):
                seen = store.view(n, heads, dim).abs().amax(dim=(0, 2))  # [KVH]
                absmax[layer, which] = torch.maximum(absmax[layer, which], seen)
    scales = (absmax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny).cpu()
    return [(s[0], s[1]) for s in scales]


def set_cache_scales(
    kv_caches: Sequence[kernels.PagedKVCache],
    scales: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Give each layer's static-scale cache its (key_scale, value_scale)."""
    for cache, (key_scale, value_scale) in zip(kv_caches, scales, strict=True):
        device = cache.key.device
        kernels.set_static_scales(cache, key_scale.to(device), value_scale.to(device))


CHECKPOINT_SCALE_NAMES = ("k_scale", "v_scale")


def pop_checkpoint_kv_scales(
    checkpoint: dict[str, torch.Tensor], num_layers: int, num_kv_heads: int
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Remove `model.layers.N.self_attn.{k,v}_scale` from `checkpoint` and return
    them as (key_scale [KVH], value_scale [KVH]) float32 per layer (a scalar is
    broadcast over the heads); None when the checkpoint has none. Raises ValueError
    naming the problem when some layer lacks one, a name is out of range, or a
    scale is misshapen, not positive or not finite."""
    found: dict[tuple[int, str], torch.Tensor] = {}
    for name in [n for n in checkpoint if n.endswith(CHECKPOINT_SCALE_NAMES)]:
        parts = name.split(".")
        if (
            len(parts) != 5
            or parts[:2] != ["model", "layers"]
            or parts[3] != "self_attn"
            or not parts[2].isdigit()
            or int(parts[2]) >= num_layers
        ):
            raise ValueError(f"KV scale {name!r} names no attention layer of the model")
        found[int(parts[2]), parts[4]] = checkpoint.pop(name)
    if not found:
        return None
    scales = []
    for layer in range(num_layers):
        pair = []
        for kind in CHECKPOINT_SCALE_NAMES:
            name = f"model.layers.{layer}.self_attn.{kind}"
            if (layer, kind) not in found:
                raise ValueError(f"the checkpoint has KV scales but lacks {name}")
            scale = found[layer, kind].float().reshape(-1)
            if scale.numel() not in (1, num_kv_heads):
                raise ValueError(
                    f"{name} has {scale.numel()} values; need 1 or {num_kv_heads}"
                )
            if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
                raise ValueError(f"{name} must be positive and finite")
            pair.append(scale.expand(num_kv_heads).clone())
        scales.append((pair[0], pair[1]))
    return scales


def calibrate_kv_caches(model, tokenizer, kv_caches) -> None:
    """Give the static-scale `kv_caches` (one per layer) their scales: the
    checkpoint's own (`model.checkpoint_kv_scales`, the caches then unrotated), or
    calibrated on the built-in calibration text; a no-op for layouts without
    static scales. int4c caches get their key means instead (engine.kv_int4c),
    from the same text."""
    if kv_caches and kv_caches[0].dtype == kv_int4c.DTYPE:
        means = kv_int4c.key_means(model, calibration_sequences(tokenizer))
        kv_int4c.set_key_means(kv_caches, means)
        return
    if not kv_caches or not kv_caches[0].static_scales:
        return
    if is_mla(model.config):  # the latent's static scale per layer (int8, fp8)
        calibrate_latent_scales(model, calibration_sequences(tokenizer), kv_caches)
        return
    checkpoint_scales = getattr(model, "checkpoint_kv_scales", None)
    if checkpoint_scales is not None:
        for cache in kv_caches:
            cache.rotated = False  # the scales were computed on unrotated K/V
        set_cache_scales(kv_caches, checkpoint_scales)
        return
    sequences = calibration_sequences(tokenizer)
    set_cache_scales(
        kv_caches, static_kv_scales(model, sequences, kv_caches[0].rotated)
    )
