"""The Hugging Face architectures archc reads, grouped by family of model types."""
