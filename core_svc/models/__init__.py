"""Our implementations of Hugging Face decoder-only architectures, fed one flattened batch per step."""
