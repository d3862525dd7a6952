"""GGUF models (llama.cpp, Ollama, LM Studio files) read as checkpoints: header (header.py), ggml types and their
exact dequantizers (quants.py), the architectures' HF meaning (archs.py), the Checkpoint (open.py) and the tokenizer
(tokenizer.py). docs/design/formats.md, section GGUF."""
