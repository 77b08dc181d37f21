"""Interchange with other tools: Hugging Face safetensors directories (export and import of weights)."""
