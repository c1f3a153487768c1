// The llama.cpp peer of `gpuagent.benches.llamacpp`: node-llama-cpp's prebuilt CPU
// llama.cpp, driven over stdin/stdout so the bench can alternate rounds with ours.
//
//   node llamacpp_peer.mjs PACKAGE_DIR GGUF THREADS [CONTEXT]
//
// PACKAGE_DIR is the npm --prefix folder holding node_modules/node-llama-cpp; CONTEXT
// the context size in tokens (default 512: prompt and new tokens must fit). Never
// builds from source or downloads anything (build: "never", skipDownload). Prints
// {"ready": ...} once the model is loaded, then for each stdin line
// {"prompt": [ids], "new_tokens": N} one line {"tokens": [...], "decode_s": S,
// "prefill_s": P}: S is the time from the first generated token to the N-th (N - 1
// decode steps, prompt processing excluded), measured in this process.
import { createInterface } from "node:readline";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [packageDir, ggufPath, threadsArg, contextArg] = process.argv.slice(2);
if (!packageDir || !ggufPath || !threadsArg) {
  console.error("usage: node llamacpp_peer.mjs PACKAGE_DIR GGUF THREADS [CONTEXT]");
  process.exit(2);
}
const threads = Number(threadsArg);
const contextSize = Number(contextArg ?? 512);
const entry = join(packageDir, "node_modules", "node-llama-cpp", "dist", "index.js");
const { getLlama, LlamaLogLevel } = await import(pathToFileURL(entry).href);

const llama = await getLlama({
  gpu: false,
  build: "never",
  skipDownload: true,
  usePrebuiltBinaries: true,
  progressLogs: false,
  logLevel: LlamaLogLevel.error,
  maxThreads: threads,
});
const model = await llama.loadModel({ modelPath: ggufPath, gpuLayers: 0 });
const context = await model.createContext({
  contextSize,
  batchSize: 512,
  sequences: 1,
  threads,
});
const sequence = context.getSequence();
const write = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
write({
  ready: true,
  build: llama.buildType,
  gpu: llama.gpu,
  cpu_threads: context.currentThreads ?? threads,
  llama_cpp: llama.llamaCppRelease?.release ?? null,
});

for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue;
  const { prompt, new_tokens: newTokens } = JSON.parse(line);
  await sequence.clearHistory();
  const tokens = [];
  let start = performance.now();
  let first = 0;
  let prefill = 0;
  for await (const token of sequence.evaluate(prompt, { temperature: 0 })) {
    tokens.push(token);
    if (tokens.length === 1) {
      first = performance.now();
      prefill = first - start;
    }
    if (tokens.length >= newTokens) break;
  }
  const decode = performance.now() - first;
  write({ tokens, decode_s: decode / 1e3, prefill_s: prefill / 1e3 });
}
await context.dispose();
await model.dispose();
await llama.dispose();
