"""Model assets the project builds for itself: converters from other formats into the
Hugging Face folders the engine serves (`from_gguf`), where the packaged real
model's source file is (`smollm2`), and the shipped demo model's training script
(`train_demo`) and the corpus it reads (`corpus`)."""
