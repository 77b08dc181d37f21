"""Inference on what was trained: eval and generate under any layout (docs/inference.md)."""
