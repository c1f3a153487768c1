"""AutoRound (Intel's `auto-round` package) on one model, run by
gpuagent.benches.autoround_compare inside AutoRound's own virtualenv: it imports
nothing from this project, so that environment needs only torch, transformers and
auto-round.

    python autoround_runner.py --model-dir DIR --calibration FILE --out DIR
        --group-size 128 [--asym] --iters 200 --threads 2

`--calibration` is a JSON list of token-id lists (the project's calibration
sequences, written by the bench), fed to AutoRound as they are, one [1, T] tensor
each, so both sides tune on the same tokens. Layers whose input width the group
does not divide get the largest of group, group/2, ... down to 32 that does (as the
project's recipes do: SmolLM2's 576 -> 64 under g128), through AutoRound's
`layer_config`. The result is saved in the `auto_gptq` layout
(gpuagent.benches.gptq_convert reads it). Prints one JSON line: the seconds from
loading the model to the saved folder (`seconds`), and the package versions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def group_for(in_features: int, group: int) -> int:
    while group >= 32 and in_features % group:
        group //= 2
    if group < 32:
        raise SystemExit(f"no int4 group of 32..{group} divides {in_features}")
    return group


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--asym", action="store_true")
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)

    import auto_round
    import torch
    import transformers
    from auto_round import AutoRound

    torch.set_num_threads(args.threads)
    with open(args.calibration) as f:
        sequences = json.load(f)
    seqlen = len(sequences[0])
    if any(len(s) != seqlen for s in sequences):
        raise SystemExit("calibration sequences differ in length")
    data = [torch.tensor([s], dtype=torch.long) for s in sequences]

    start = time.monotonic()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, torch_dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    layer_config = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            g = group_for(module.in_features, args.group_size)
            if g != args.group_size:
                layer_config[name] = {"group_size": g}
    rounder = AutoRound(
        model,
        tokenizer,
        bits=4,
        group_size=args.group_size,
        sym=not args.asym,
        iters=args.iters,
        nsamples=len(data),
        seqlen=seqlen,
        batch_size=8,
        dataset=data,
        layer_config=layer_config,
        device_map="cpu",
        amp=False,
        enable_torch_compile=False,  # ours runs eager too
    )
    rounder.quantize_and_save(args.out, format="auto_gptq")
    seconds = time.monotonic() - start
    print(
        json.dumps(
            {
                "seconds": seconds,
                "auto_round": auto_round.__version__,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "layer_config": layer_config,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
