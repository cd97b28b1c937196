"""lightning_llm: PyTorch Lightning components for LLM post-training research."""
