"""What a model is and where it comes from: specs, the hub, the bundled GGUF, adapters, the memory guard."""
