"""Benchmarks that drive several layers of the agent and print ratios, one run each,
side by side; each is a script, `python -m gpuagent.benches.<name>`:

- `engine`: KV memory, capacity, throughput and KV quality of the serving engine
  (with `kv_alternatives`: KV layouts measured beside the served ones, not served);
- `kv_long`: every KV dtype vs bf16 KV on held-out passages of 2k+ tokens, scored
  whole (overall and at positions >= 512; bytes at the measured length);
- `compress`: weight compression's size, quality, decode speed and matmuls;
- `llamacpp`: batch-1 w4a16 decode speed vs llama.cpp on the Q4_1 GGUF (optional
  peer, `make llama-cpp-peer`);
- `compress_memory`: compression's peak memory and speed, layer by layer vs in
  memory, on synthetic models of 0.5 to 2 GiB;
- `lossless`: the lossless checkpoint coding vs zipnn;
- `integrity`: verify speed vs model_signing and plain reads, hostile inputs;
- `serving`: what the agent's check and the engine's verify-on-load add to a deploy;
- `load_plan`: the default load plan's wall time, knee and goodput per workload;
- `http_eval`: the gate's quality evidence over HTTP (servers started through the
  environment's backend) vs in process, agreement and time;
- `guidellm_compare`: our plan's knee and goodput against guidellm's, one server;
- `gpu_placement`: on a CUDA device, servers on their placement (devices, memory
  budget), warm vs cold rollback (`make gpu-check` runs it with the kernel and
  engine benches).

They live above the layers they drive, so that no serving module imports the
evaluator or the compressor because a bench sits beside it; nothing outside this
package imports it (tests aside; tests/test_layering.py checks both).
"""

from pathlib import Path

# The demo model that ships with the engine, which every bench runs on by default.
DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "engine" / "demo_model"
