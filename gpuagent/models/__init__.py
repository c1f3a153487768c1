"""Model assets the project builds for itself: converters from other formats into the
Hugging Face folders the engine serves (`from_gguf`), and where the packaged real
model's source file is (`smollm2`)."""
